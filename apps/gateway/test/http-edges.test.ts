import { connect, type Socket } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
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
