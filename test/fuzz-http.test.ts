import { connect } from 'node:net';
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import type { GatewayProcess } from './support/sluice.js';

/** Sends raw bytes, returns what came back before the server closed or `ms` passed. */
function exchange(url: string, bytes: string, ms = 400): Promise<string> {
  const { port } = new URL(url);
  return new Promise((resolve) => {
    const socket = connect(Number(port), '127.0.0.1');
    let reply = '';
    const timer = setTimeout(() => socket.destroy(), ms);
    socket.on('data', (chunk: Buffer) => (reply += chunk.toString('latin1')));
    socket.on('error', () => undefined);
    socket.on('close', () => {
      clearTimeout(timer);
      resolve(reply);
    });
    socket.on('connect', () => socket.write(Buffer.from(bytes, 'latin1')));
  });
}

/** Every HTTP reply in `raw` (pipelined replies included): status and body, for the error checks. */
function replies(raw: string): Array<{ status: number; body: string }> {
  const out: Array<{ status: number; body: string }> = [];
  for (const match of raw.matchAll(/HTTP\/1\.1 (\d{3})[^\r]*\r\n([\s\S]*?)\r\n\r\n/g)) {
    const headers = match[2]!.toLowerCase();
    const length = /content-length: (\d+)/.exec(headers);
    const start = match.index + match[0].length;
    const body = length !== null ? raw.slice(start, start + Number(length[1])) : raw.slice(start, start + 2000);
    out.push({ status: Number(match[1]), body });
  }
  return out;
}

function checkErrorReply({ status, body }: { status: number; body: string }): void {
  expect(status, body).toBeLessThan(500);
  if (status >= 400) {
    // Chunked replies carry a size line first; the JSON object is what matters.
    const json = body.slice(body.indexOf('{'), body.lastIndexOf('}') + 1);
    const parsed = JSON.parse(json) as { error?: { message?: string } };
    expect(parsed.error?.message, body).toMatch(/\S/);
  }
}

const validChat = { model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 };

describe('fuzzing a running gateway (bodies and raw HTTP framing)', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker();
    gateway = await cluster.gateway();
  });

  afterAll(async () => {
    await cluster?.stop();
  });

  it('answers any JSON body with a 2xx or a 4xx carrying an OpenAI error body', async () => {
    // Valid bodies with fields replaced by anything, and arbitrary JSON.
    const mutated = fc
      .record({
        key: fc.constantFrom(
          'model',
          'messages',
          'max_tokens',
          'stream',
          'n',
          'temperature',
          'stop',
          'logprobs',
          'top_logprobs',
          'prompt',
          'stream_options',
          'resume_grace_ms',
        ),
        value: fc.jsonValue({ maxDepth: 3 }),
        stream: fc.boolean(),
      })
      .map(({ key, value, stream }) => JSON.stringify({ ...validChat, stream, [key]: value }));
    const body = fc.oneof(mutated, fc.json({ maxDepth: 3 }), fc.string({ maxLength: 200 }));
    await fc.assert(
      fc.asyncProperty(body, fc.constantFrom('/v1/chat/completions', '/v1/completions'), async (text, path) => {
        const res = await fetch(`${gateway.url}${path}`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: text });
        const reply = await res.text();
        expect(res.status, `${text} → ${reply}`).toBeLessThan(500);
        if (res.status >= 400) expect((JSON.parse(reply) as { error: { message: string } }).error.message).toMatch(/\S/);
      }),
      { numRuns: 150 },
    );
  });

  it('answers broken HTTP framing with a 4xx carrying an OpenAI error body, or not at all, and never crashes', async () => {
    const piece = fc.oneof(
      fc.constantFrom(
        'POST /v1/chat/completions HTTP/1.1\r\n',
        'GET /readyz HTTP/1.1\r\n',
        'GET /v1/models HTTP/1.0\r\n',
        'Host: x\r\n',
        'Content-Type: application/json\r\n',
        'Content-Length: 10\r\n',
        'Content-Length: -1\r\n',
        'Content-Length: 99999999999\r\n',
        'Transfer-Encoding: chunked\r\n',
        'Transfer-Encoding: chunked, gzip\r\n',
        `X-Long: ${'a'.repeat(70_000)}\r\n`,
        '\r\n',
        '5\r\nhello\r\n',
        'zz\r\n',
        '0\r\n\r\n',
        JSON.stringify(validChat),
        '\0',
      ),
      fc.string({ maxLength: 40 }),
    );
    await fc.assert(
      fc.asyncProperty(fc.array(piece, { minLength: 1, maxLength: 8 }), async (pieces) => {
        const raw = await exchange(gateway.url, pieces.join(''));
        for (const reply of replies(raw)) checkErrorReply(reply);
      }),
      { numRuns: 150 },
    );
    expect(gateway.process.child.exitCode).toBeNull();
    expect((await gateway.get('/readyz')).status).toBe(200);
  });
});
