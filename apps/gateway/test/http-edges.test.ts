import { connect, type Socket } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import type { GenerateJob } from '@sluice/protocol';
import { closeAppHarnesses, startAppHarness as start, type AppHarness } from './support/app-harness.js';

afterEach(closeAppHarnesses);

/** Sends raw bytes and reads the whole reply until the server closes (or `ms` pass). */
function rawExchange(h: AppHarness, write: (socket: Socket) => void, ms = 5_000): Promise<string> {
  const { port } = new URL(h.url);
  return new Promise((resolve) => {
    const socket = connect(Number(port), '127.0.0.1');
    let reply = '';
    const timer = setTimeout(() => socket.destroy(), ms);
    socket.on('data', (chunk: Buffer) => (reply += chunk.toString('utf8')));
    socket.on('error', () => undefined);
    socket.on('close', () => {
      clearTimeout(timer);
      resolve(reply);
    });
    socket.on('connect', () => write(socket));
  });
}

function parseReply(reply: string): { status: number; headers: string; body: unknown } {
  const [head = '', body = ''] = reply.split('\r\n\r\n', 2);
  return { status: Number(head.split(' ')[1]), headers: head, body: body === '' ? undefined : JSON.parse(body) };
}

/**
 * Reads one HTTP/1.1 reply with a chunked body off the front of `raw`, byte-exactly: each chunk's
 * size line, exactly that many bytes, then CRLF, until the zero chunk. Throws on any framing error.
 */
function readChunkedReply(raw: Buffer): { head: string; body: Buffer; rest: Buffer } {
  const headEnd = raw.indexOf('\r\n\r\n');
  if (headEnd === -1) throw new Error('no complete head');
  const head = raw.subarray(0, headEnd).toString('latin1');
  if (!/transfer-encoding: chunked/i.test(head)) throw new Error(`not chunked: ${head}`);
  const parts: Buffer[] = [];
  let at = headEnd + 4;
  for (;;) {
    const lineEnd = raw.indexOf('\r\n', at);
    if (lineEnd === -1) throw new Error('truncated chunk size line');
    const sizeLine = raw.subarray(at, lineEnd).toString('latin1');
    if (!/^[0-9a-f]+$/.test(sizeLine)) throw new Error(`bad chunk size line ${JSON.stringify(sizeLine)}`);
    const size = parseInt(sizeLine, 16);
    at = lineEnd + 2;
    if (size === 0) {
      if (raw.subarray(at, at + 2).toString('latin1') !== '\r\n') throw new Error('no CRLF after the last chunk');
      return { head, body: Buffer.concat(parts), rest: raw.subarray(at + 2) };
    }
    parts.push(raw.subarray(at, at + size));
    if (raw.subarray(at + size, at + size + 2).toString('latin1') !== '\r\n')
      throw new Error(`chunk of ${size} bytes not followed by CRLF`);
    at += size + 2;
  }
}

/** A kept-alive raw connection: what it received so far, as bytes. */
function rawConnection(h: AppHarness): { socket: Socket; received: () => Buffer } {
  const { port } = new URL(h.url);
  const socket = connect(Number(port), '127.0.0.1');
  const chunks: Buffer[] = [];
  socket.on('data', (chunk: Buffer) => chunks.push(chunk));
  socket.on('error', () => undefined);
  return { socket, received: () => Buffer.concat(chunks) };
}

const streamRequest = (version = '1.1') => {
  const body = JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true });
  return `POST /v1/chat/completions HTTP/${version}\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n${body}`;
};

/** The deltas' content of an SSE body, joined. */
const contentOf = (body: string): string =>
  [...body.matchAll(/^data: (\{.*\})$/gm)]
    .map((m) => (JSON.parse(m[1]!) as { choices: Array<{ delta?: { content?: string } }> }).choices[0]?.delta?.content ?? '')
    .join('');

const TEXTS = ['plain ascii', ' é', ' 東京', ' 🙂', ' "quoted"\n', ' ÿ', ' end'];

async function streamTexts(h: AppHarness, job: GenerateJob): Promise<void> {
  h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 2 }], job);
  for (const text of TEXTS) {
    h.send([{ type: 'text-delta', index: 0, text, tokens: 1 }], job);
    await new Promise((resolve) => setImmediate(resolve));
  }
  h.send(
    [
      { type: 'text-end', index: 0, finishReason: 'length' },
      { type: 'finish', usage: { promptTokens: 2, completionTokens: TEXTS.length } },
    ],
    job,
  );
}

describe('HTTP edges', () => {
  it("closes a stream's connection after [DONE] when the client asked for Connection: close", async () => {
    const h = await start();
    const job = h.nextJob();
    const body = JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true });
    const reply = rawExchange(h, (socket) =>
      socket.write(
        `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n${body}`,
      ),
    );
    await job;
    h.send([
      { type: 'accepted', workerId: 'w1', promptTokens: 2 },
      { type: 'text-delta', index: 0, text: 'x', tokens: 1 },
      { type: 'text-end', index: 0, finishReason: 'length' },
      { type: 'finish', usage: { promptTokens: 2, completionTokens: 1 } },
    ]);
    // The server closes it (rawExchange resolves on close; its own timer would leave no [DONE] unread).
    const raw = await reply;
    expect(raw.toLowerCase()).toContain('connection: close');
    expect(raw).toContain('data: [DONE]');
  });

  it('frames a stream as exact HTTP/1.1 chunks, text outside ASCII included, and keeps the connection for the next request', async () => {
    const h = await start();
    const client = rawConnection(h);
    const job = h.nextJob();
    client.socket.write(streamRequest());
    await streamTexts(h, await job);
    await expect.poll(() => client.received().includes('data: [DONE]')).toBe(true);
    await expect.poll(() => client.received().subarray(-5).toString('latin1')).toBe('0\r\n\r\n');
    const first = readChunkedReply(client.received());
    expect(first.head).toMatch(/^HTTP\/1\.1 200/);
    expect(contentOf(first.body.toString('utf8'))).toBe(TEXTS.join(''));
    expect(first.rest.length).toBe(0);
    // The same connection serves another request afterwards.
    client.socket.write('GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n');
    await expect.poll(() => client.received().length > first.head.length + first.body.length + 100).toBe(true);
    await expect.poll(() => /"object":"list"/.test(client.received().toString('utf8'))).toBe(true);
    client.socket.destroy();
  });

  it('streams two pipelined requests on one connection in order, the second buffered until the first ends', async () => {
    const h = await start();
    const client = rawConnection(h);
    const jobs = [h.nextJob()];
    client.socket.write(streamRequest());
    const first = await jobs[0]!;
    jobs.push(h.nextJob());
    client.socket.write(streamRequest());
    const second = await jobs[1]!;
    // The second reply's events come while the first still holds the connection.
    await streamTexts(h, second);
    await streamTexts(h, first);
    await expect.poll(() => client.received().toString('latin1').split('data: [DONE]').length - 1).toBe(2);
    await expect.poll(() => client.received().subarray(-5).toString('latin1')).toBe('0\r\n\r\n');
    const one = readChunkedReply(client.received());
    const two = readChunkedReply(one.rest);
    expect(two.rest.length).toBe(0);
    expect(one.head).toContain(`X-Request-Id: ${first.requestId}`);
    expect(two.head).toContain(`X-Request-Id: ${second.requestId}`);
    expect(contentOf(one.body.toString('utf8'))).toBe(TEXTS.join(''));
    expect(contentOf(two.body.toString('utf8'))).toBe(TEXTS.join(''));
    client.socket.destroy();
  });

  it('streams to an HTTP/1.0 client without chunked framing and closes the connection at the end', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = rawExchange(h, (socket) => socket.write(streamRequest('1.0')));
    await streamTexts(h, await job);
    const raw = await reply;
    const [head = '', body = ''] = raw.split('\r\n\r\n', 2);
    expect(head).not.toMatch(/transfer-encoding/i);
    // The bare event stream: no chunk size lines.
    expect(body.startsWith('id: 0\ndata: {')).toBe(true);
    expect(body).not.toContain('\r\n');
    expect(contentOf(body)).toBe(TEXTS.join(''));
    expect(body.endsWith('\ndata: [DONE]\n\n')).toBe(true);
  });

  it('answers headers too large with 431 and an OpenAI error body', async () => {
    const h = await start();
    const reply = await rawExchange(h, (s) => s.write(`GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(20_000)}\r\n\r\n`));
    const { status, body } = parseReply(reply);
    expect(status).toBe(431);
    expect(body).toMatchObject({ error: { code: 'headers_too_large', type: 'invalid_request_error' } });
  });

  it('answers broken framing with 400 and an OpenAI error body', async () => {
    const h = await start();
    const reply = await rawExchange(h, (s) => s.write('POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: banana\r\n\r\n'));
    const { status, body } = parseReply(reply);
    expect(status).toBe(400);
    expect(body).toMatchObject({ error: { code: 'bad_http_request', message: expect.any(String) } });
  });

  it('answers an HTTP/1.1 request without Host with 400 and an OpenAI error body', async () => {
    const h = await start();
    const reply = await rawExchange(h, (s) => s.write('POST /v1/chat/completions HTTP/1.1\r\nConnection: close\r\n\r\n'));
    const { status, body } = parseReply(reply);
    expect(status).toBe(400);
    expect(body).toMatchObject({ error: { code: 'bad_http_request' } });
  });

  it('answers a chunked body over MAX_BODY_BYTES with 413 while the client keeps sending', async () => {
    const h = await start({ MAX_BODY_BYTES: '1024' });
    const reply = await rawExchange(h, (s) => {
      s.write('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n');
      const chunk = 'x'.repeat(512);
      let sent = 0;
      // A client that would send forever: the reply must come anyway, and the connection close.
      const timer = setInterval(() => {
        if (s.destroyed || sent++ > 200) return clearInterval(timer);
        s.write(`${chunk.length.toString(16)}\r\n${chunk}\r\n`, () => undefined);
      }, 5);
      s.on('close', () => clearInterval(timer));
    });
    const { status, headers, body } = parseReply(reply);
    expect(status).toBe(413);
    expect(headers.toLowerCase()).toContain('connection: close');
    expect(body).toMatchObject({ error: { code: 'request_too_large' } });
    expect(h.jobs).toEqual([]);
  });

  it('answers a cancel that declares a body over MAX_BODY_BYTES with 413, without reading it', async () => {
    const h = await start({ MAX_BODY_BYTES: '1024' });
    const reply = await rawExchange(h, (s) => {
      s.write(
        'POST /v1/chat/completions/chatcmpl-x/cancel HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n',
      );
      s.write('x'.repeat(4096));
    });
    const { status, headers, body } = parseReply(reply);
    expect(status).toBe(413);
    expect(headers.toLowerCase()).toContain('connection: close');
    expect(body).toMatchObject({ error: { code: 'request_too_large' } });
  });

  it('answers a compressed body with 415 naming its encoding, and closes the connection', async () => {
    const h = await start();
    const reply = await rawExchange(h, (s) => {
      const gzip = Buffer.from([0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00]);
      s.write(
        `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: ${gzip.length}\r\n\r\n`,
      );
      s.write(gzip);
    });
    const { status, headers, body } = parseReply(reply);
    expect(status).toBe(415);
    expect(headers.toLowerCase()).toContain('connection: close');
    expect(body).toMatchObject({ error: { code: 'unsupported_media_type', message: expect.stringContaining("'gzip'") as unknown } });
    expect(h.jobs).toEqual([]);
  });

  it('counts a client that leaves mid-body as a client event, not an internal error', async () => {
    const h = await start();
    await rawExchange(h, (s) => {
      s.write('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model":');
      setTimeout(() => s.destroy(), 50);
    });
    await expect.poll(() => h.value('sluice_gateway_rejected_total', { reason: 'client_closed' })).toBe(1);
    expect(await h.value('sluice_gateway_rejected_total', { reason: 'internal' })).toBe(0);
    expect(await h.value('sluice_gateway_requests_total', { status: '500' })).toBe(0);
  });
});
