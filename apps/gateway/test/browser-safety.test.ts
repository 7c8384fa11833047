import { afterEach, describe, expect, it, vi } from 'vitest';
import { closeAppHarnesses, startAppHarness as start, type AppHarness } from './support/app-harness.js';

afterEach(async () => {
  vi.restoreAllMocks();
  await closeAppHarnesses();
});

const SECURITY = { 'x-content-type-options': 'nosniff', 'x-frame-options': 'DENY', 'referrer-policy': 'no-referrer' };

/** A streamed completion through the harness, answered by hand; resolves to its reply headers. */
async function streamHeaders(h: AppHarness, headers: Record<string, string>): Promise<Headers> {
  const job = h.nextJob();
  const reply = fetch(`${h.url}/v1/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...headers },
    body: JSON.stringify({ model: 'm', prompt: 'hi', max_tokens: 1, stream: true }),
  });
  await job;
  h.send([
    { type: 'accepted', workerId: 'w1', promptTokens: 2 },
    { type: 'text-delta', index: 0, text: 'a', tokens: 1 },
    { type: 'text-end', index: 0, finishReason: 'length' },
    { type: 'finish', usage: { promptTokens: 2, completionTokens: 1 } },
  ]);
  const res = await reply;
  await res.text();
  // Whatever @hono/node-server would still do with the request happens on the same turn as the end.
  await new Promise((resolve) => setTimeout(resolve, 20));
  return res.headers;
}

async function jsonHeaders(h: AppHarness, headers: Record<string, string>): Promise<Headers> {
  const res = await fetch(`${h.url}/healthz`, { headers });
  await res.text();
  return res.headers;
}

describe('browser safety headers, with and without an Origin', () => {
  it('gives a request with no Origin the headers hono/cors gives it, and the security headers (CORS_ORIGINS=*)', async () => {
    const errors = vi.spyOn(console, 'error');
    const h = await start({ CORS_ORIGINS: '*' });
    for (const headers of [await jsonHeaders(h, {}), await streamHeaders(h, {}), await streamHeaders(h, { Origin: 'https://page.test' })]) {
      expect(headers.get('access-control-allow-origin')).toBe('*');
      expect(headers.get('access-control-expose-headers')).toMatch(/x-request-id/);
      expect(headers.get('access-control-expose-headers')).toMatch(/x-stream-id/);
      expect(Object.fromEntries(Object.keys(SECURITY).map((name) => [name, headers.get(name)]))).toEqual(SECURITY);
    }
    // A stream is one reply: nothing tries to send a second head after it (ERR_HTTP_HEADERS_SENT).
    expect(errors).not.toHaveBeenCalled();
  });

  it('allows only a listed origin, says Vary: Origin to caches, and keeps the security headers on every reply', async () => {
    const errors = vi.spyOn(console, 'error');
    const h = await start({ CORS_ORIGINS: 'https://page.test' });
    for (const reply of [jsonHeaders, streamHeaders]) {
      const plain = await reply(h, {});
      expect(plain.get('access-control-allow-origin')).toBeNull();
      expect(plain.get('vary')).toMatch(/Origin/i);
      const listed = await reply(h, { Origin: 'https://page.test' });
      expect(listed.get('access-control-allow-origin')).toBe('https://page.test');
      expect(listed.get('access-control-expose-headers')).toMatch(/x-request-id/);
      expect(listed.get('vary')).toMatch(/Origin/i);
      const other = await reply(h, { Origin: 'https://other.test' });
      expect(other.get('access-control-allow-origin')).toBeNull();
      for (const headers of [plain, listed, other]) {
        expect(Object.fromEntries(Object.keys(SECURITY).map((name) => [name, headers.get(name)]))).toEqual(SECURITY);
      }
    }
    expect(errors).not.toHaveBeenCalled();
  });
});
