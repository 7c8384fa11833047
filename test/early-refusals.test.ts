import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import type { GatewayProcess } from './support/sluice.js';

/**
 * Refusals that depend only on the request come from the gateway as an HTTP 400 before any 200, even
 * for a stream that commits its headers at once (HEADERS_WAIT_MS=0): real redis-server, worker and
 * gateway processes, plain HTTP.
 */
describe('refusals decided before the stream starts', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker();
    gateway = await cluster.gateway({ HEADERS_WAIT_MS: '0' });
  });

  afterAll(async () => {
    await cluster?.stop();
  });

  const post = (path: string, body: unknown) =>
    fetch(`${gateway.url}${path}`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
  const chat = (extra: Record<string, unknown>) => ({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 6, ...extra });

  it('refuses an empty stop string with a 400 naming it, before anything is streamed', async () => {
    for (const [stop, param] of [
      [['a', ''], 'stop[1]'],
      ['', 'stop'],
    ] as const) {
      const res = await post('/v1/chat/completions', chat({ stream: true, stop }));
      expect(res.status).toBe(400);
      expect(res.headers.get('content-type')).toMatch(/application\/json/);
      const { error } = (await res.json()) as { error: { message: string; param: string; code: string } };
      expect(error).toMatchObject({ param, code: 'invalid_request' });
      expect(error.message).toBe(`${param}: must be a non-empty string.`);
    }
  });

  it.skipIf(FAKE_ENGINE)('refuses a 4 MB chat message by its size alone, naming the field', async () => {
    const res = await post('/v1/chat/completions', chat({ stream: true, messages: [{ role: 'user', content: 'word '.repeat(800_000) }] }));
    expect(res.status).toBe(400);
    const { error } = (await res.json()) as { error: { message: string; param: string; code: string } };
    expect(error).toMatchObject({ param: 'messages', code: 'context_length_exceeded' });
    // "at least": the count comes from the byte length, the prompt was never encoded.
    expect(error.message).toMatch(
      /^This model's maximum context length is 2048 tokens\. However, your prompt is at least \d+ tokens long\.$/,
    );
  });

  it.skipIf(FAKE_ENGINE)('serves a prompt whose bytes come close to the bound but whose tokens fit', async () => {
    // 2000 special tokens of 13 bytes each, the tiny vocabulary's longest: 26,000 bytes, 2000 tokens.
    const res = await post('/v1/completions', { model: MODEL, prompt: '<|endoftext|>'.repeat(2000), max_tokens: 4 });
    expect(res.status, await res.clone().text()).toBe(200);
    const body = (await res.json()) as { usage: { prompt_tokens: number } };
    expect(body.usage.prompt_tokens).toBe(2000);
  });
});
