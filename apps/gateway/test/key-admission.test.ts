import type { ServerResponse } from 'node:http';
import { connect, type Socket } from 'node:net';
import type { Redis } from 'ioredis';
import { pino } from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { RequestScripts, redisNames } from '@sluice/protocol';
import { startRedis, type RedisServer } from '../../../test/support/redis-server.js';
import { startAccessControl } from '../src/auth/access-control.js';
import { hashApiKey, type ApiKeyLimits } from '../src/auth/api-key.js';
import { ApiKeyStore } from '../src/auth/api-key-store.js';
import type { AuthenticatedKey } from '../src/auth/auth-middleware.js';
import { KeyAdmission, type KeyGrant } from '../src/auth/key-admission.js';
import type { KeyUsageRecorder } from '../src/auth/key-usage-recorder.js';
import { RateLimiter } from '../src/auth/rate-limiter.js';
import { loadGatewayConfig } from '../src/config.js';
import { GatewayError } from '../src/errors.js';
import type { RequestEnd } from '../src/hooks.js';
import { parseChatRequest } from '../src/openai/request-schemas.js';
import { noObserver } from '../src/responders/responder-context.js';
import { closeAppHarnesses, startAppHarness } from './support/app-harness.js';

/**
 * What a key's grant keeps when a delivery of its request ends while the work goes on (`detached`):
 * its stream slot for the grace and its whole token reservation — whether the client left, did not
 * read (slow client), was cut by a draining gateway, or was taken over by a resume. Real redis-server,
 * the real limiter scripts.
 */

const GRACE_MS = 30_000;
const PREFIX = 'ka-test';

describe('KeyAdmission: a delivery whose work goes on', () => {
  let server: RedisServer;
  let redis: Redis;
  let store: ApiKeyStore;
  let limiter: RateLimiter;
  let admission: KeyAdmission;
  const refusals: string[] = [];
  const usage: KeyUsageRecorder = { admitted() {}, used() {}, refused: (_name, reason) => refusals.push(reason), authFailed() {} };
  let keyCount = 0;

  beforeAll(async () => {
    server = await startRedis();
    redis = server.client();
    store = new ApiKeyStore(redis, PREFIX);
    limiter = new RateLimiter(redis, PREFIX);
    admission = new KeyAdmission(limiter, usage, pino({ level: 'silent' }), 600_000, new RequestScripts(redis, redisNames(PREFIX)));
  });

  afterAll(async () => {
    await closeAppHarnesses();
    redis?.disconnect();
    await server?.stop();
  });

  afterEach(closeAppHarnesses);

  const newKey = async (limits: ApiKeyLimits): Promise<{ key: string; auth: AuthenticatedKey }> => {
    const name = `key${++keyCount}`;
    const key = await store.create(name, limits);
    return { key, auth: { hash: hashApiKey(key), record: { name, limits, createdAt: Date.now() } } };
  };
  const noHeaders = { setHeader() {} } as unknown as ServerResponse;
  const request = parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 'hi' }], max_tokens: 40, stream: true });
  const admit = (auth: AuthenticatedKey, requestId: string) =>
    admission.admit(auth, request, [{ ids: [1, 2, 3], maxTokens: 40 }], requestId, noHeaders);

  const redisNow = async () => {
    const [seconds, micros] = await redis.time();
    return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
  };
  /** ms until the request's slot lapses (undefined: no slot). */
  const slotLeft = async (auth: AuthenticatedKey, requestId: string) => {
    const score = await redis.zscore(limiter.keys(auth.hash)[4]!, requestId);
    return score === null ? undefined : Number(score) - (await redisNow());
  };
  const end = (grant: KeyGrant, info: RequestEnd, graceMs = GRACE_MS) =>
    admission.observe(grant, noObserver(), graceMs).finished({ end: info, status: 200, promptTokens: 3, completionTokens: 5 });

  it.each<[string, RequestEnd]>([
    ['a client that left within its grace', { outcome: 'disconnect', detached: true }],
    ['a slow client whose work was detached (B4)', { outcome: 'slow_client', cause: 'buffer', detached: true }],
    ['a stream a draining gateway left for a resume elsewhere (B3)', { outcome: 'error', code: 'shutting_down', detached: true }],
  ])('keeps the slot for the grace and the whole reservation after %s', async (_what, info) => {
    const { auth } = await newKey({ maxStreams: 1, tpm: 10_000 });
    const grant = await admit(auth, 'r1');
    expect(grant.reservedTokens).toBe(43);
    end(grant, info);
    await expect.poll(() => slotLeft(auth, 'r1')).toBeLessThanOrEqual(GRACE_MS + 1_000);
    expect(await slotLeft(auth, 'r1')).toBeGreaterThan(GRACE_MS - 5_000);
    expect(await limiter.tokensInWindow(auth.hash)).toBe(43);
    await expect(admit(auth, 'r2')).rejects.toMatchObject({ code: 'rate_limit_exceeded' });
  });

  it.each<[string, RequestEnd]>([
    ['a slow client whose work stopped', { outcome: 'slow_client', cause: 'stall' }],
    ['an error', { outcome: 'error', code: 'shutting_down' }],
    ['a finished answer', { outcome: 'stop' }],
  ])('frees the slot and settles the reservation to the tokens used after %s', async (_what, info) => {
    const { auth } = await newKey({ maxStreams: 1, tpm: 10_000 });
    const grant = await admit(auth, 'r1');
    end(grant, info);
    await expect.poll(() => slotLeft(auth, 'r1')).toBeUndefined();
    expect(await limiter.tokensInWindow(auth.hash)).toBe(8);
    await admit(auth, 'r2');
  });

  it('leaves the slot to a stream resumed on this gateway when the connection it took over ends (B1)', async () => {
    const { auth } = await newKey({ maxStreams: 1, tpm: 10_000 });
    const grant = await admit(auth, 'r1');
    const resumedEnded = admission.resumed(auth, 'r1', Date.now() + 120_000, GRACE_MS);
    await expect.poll(() => slotLeft(auth, 'r1')).toBeGreaterThan(110_000);
    // The connection taken over ends (SessionManager.open): its work goes on, under the resume.
    end(grant, { outcome: 'disconnect', detached: true });
    await new Promise((resolve) => setTimeout(resolve, 100));
    expect(await slotLeft(auth, 'r1')).toBeGreaterThan(110_000);
    expect(await limiter.tokensInWindow(auth.hash)).toBe(43);
    await expect(admit(auth, 'r2')).rejects.toMatchObject({ code: 'rate_limit_exceeded' });
    // The resumed stream's end frees it.
    resumedEnded({ end: { outcome: 'stop' }, status: 200, promptTokens: 3, completionTokens: 40 });
    await expect.poll(() => slotLeft(auth, 'r1')).toBeUndefined();
    await admit(auth, 'r2');
  });

  it("settles a detached request's reservation to its real usage when a resumed stream sees it end, and only then", async () => {
    const { auth } = await newKey({ maxStreams: 1, tpm: 10_000 });
    const grant = await admit(auth, 'r1');
    end(grant, { outcome: 'disconnect', detached: true });
    await expect.poll(() => slotLeft(auth, 'r1')).toBeLessThanOrEqual(GRACE_MS + 1_000);
    // A resume that detaches again keeps the worst case.
    admission.resumed(
      auth,
      'r1',
      Date.now() + 120_000,
      GRACE_MS,
    )({
      end: { outcome: 'disconnect', detached: true },
      status: 200,
      promptTokens: 3,
      completionTokens: 10,
    });
    await new Promise((resolve) => setTimeout(resolve, 100));
    expect(await limiter.tokensInWindow(auth.hash)).toBe(43);
    // The next one sees the end: 3 + 25 tokens used.
    const ended = admission.resumed(auth, 'r1', Date.now() + 120_000, GRACE_MS);
    ended({ end: { outcome: 'stop' }, status: 200, promptTokens: 3, completionTokens: 25 });
    await expect.poll(() => limiter.tokensInWindow(auth.hash)).toBe(28);
    await expect.poll(() => slotLeft(auth, 'r1')).toBeUndefined();
    // Seen again (another resume of the ended request): the same total, not counted twice.
    admission.resumed(
      auth,
      'r1',
      Date.now() + 120_000,
      GRACE_MS,
    )({ end: { outcome: 'stop' }, status: 200, promptTokens: 3, completionTokens: 25 });
    await new Promise((resolve) => setTimeout(resolve, 100));
    expect(await limiter.tokensInWindow(auth.hash)).toBe(28);
    await admit(auth, 'r2');
  });

  it.each<[string, ApiKeyLimits]>([
    ['a tpm key', { tpm: 10_000 }],
    ['a tpm key with max-streams', { tpm: 10_000, maxStreams: 1 }],
  ])('leaves the reservation to a resume when the old connection ends after it without a grace (%s)', async (_what, limits) => {
    const { auth } = await newKey(limits);
    const grant = await admit(auth, 'r1');
    const resumedEnded = admission.resumed(auth, 'r1', Date.now() + 120_000, GRACE_MS);
    await new Promise((resolve) => setTimeout(resolve, 100));
    // The old connection closes late, its client gone without a grace, having written 5 tokens: it
    // used to settle the reservation to 8 while the generation ran on for the resume.
    end(grant, { outcome: 'disconnect' }, 0);
    await new Promise((resolve) => setTimeout(resolve, 100));
    expect(await limiter.tokensInWindow(auth.hash)).toBe(43);
    // The resume's end settles it (a stop after 30 tokens).
    resumedEnded({ end: { outcome: 'stop' }, status: 200, promptTokens: 3, completionTokens: 30 });
    await expect.poll(() => limiter.tokensInWindow(auth.hash)).toBe(33);
  });

  it('leaves the slot to a stream resumed on another gateway when the old connection ends after it, however it ends (B2)', async () => {
    for (const info of [{ outcome: 'disconnect', detached: true }, { outcome: 'stop' }] satisfies RequestEnd[]) {
      const { auth } = await newKey({ maxStreams: 1 });
      const grant = await admit(auth, 'r1');
      admission.resumed(auth, 'r1', Date.now() + 120_000, 300);
      await expect.poll(() => slotLeft(auth, 'r1')).toBeGreaterThan(110_000);
      // The old connection closes (grace 300 ms): its hold used to re-score the slot to 1.3 s.
      end(grant, info, 300);
      await new Promise((resolve) => setTimeout(resolve, 100));
      expect(await slotLeft(auth, 'r1')).toBeGreaterThan(110_000);
      await expect(admit(auth, 'r2')).rejects.toMatchObject({ code: 'rate_limit_exceeded' });
    }
  });

  it('counts a request larger than the whole TPM as tokens_over_limit (its 400), not as tokens (the 429)', async () => {
    const { auth } = await newKey({ tpm: 10 });
    refusals.length = 0;
    await expect(admit(auth, 'big')).rejects.toBeInstanceOf(GatewayError);
    expect(refusals).toEqual(['tokens_over_limit']);
  });
});

describe('a slow client with a resume grace (the real stream path)', () => {
  let server: RedisServer;
  let redis: Redis;

  beforeAll(async () => {
    server = await startRedis();
    redis = server.client();
  });

  afterAll(async () => {
    await closeAppHarnesses();
    redis?.disconnect();
    await server?.stop();
  });

  /** A raw client that sends a keyed streaming request and never reads. */
  function stalledClient(url: string, key: string): Socket {
    const { port } = new URL(url);
    const socket = connect(Number(port), '127.0.0.1');
    const body = JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true, resume_grace_ms: GRACE_MS });
    socket.write(
      `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${key}\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n${body}`,
    );
    socket.on('error', () => undefined);
    socket.pause();
    return socket;
  }

  it('detaches its work and keeps the key’s slot and reservation for the grace (B4)', async () => {
    const store = new ApiKeyStore(redis, PREFIX);
    const key = await store.create('slow', { maxStreams: 1, tpm: 10_000 });
    const config = loadGatewayConfig({ AUTH: 'keys', REDIS_PREFIX: PREFIX, HOST: '127.0.0.1' });
    const access = await startAccessControl(config, redis, pino({ level: 'silent' }), {
      admitted() {},
      used() {},
      refused() {},
      authFailed() {},
    });
    const h = await startAppHarness(
      { AUTH: 'keys', HEADERS_WAIT_MS: '0', MAX_STREAM_BUFFER_BYTES: '65536', CLIENT_STALL_TIMEOUT_MS: '0' },
      { access },
    );
    const limiter = new RateLimiter(redis, PREFIX);
    const hash = hashApiKey(key);
    const job = h.nextJob();
    const client = stalledClient(h.url, key);
    const { requestId } = await job;
    const reserved = await limiter.tokensInWindow(hash);
    expect(reserved).toBeGreaterThan(0);
    h.send([{ seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 2 }]);
    for (let i = 0; i < 20_000; i++) {
      h.send([{ seq: 1 + i, type: 'text-delta', index: 0, text: 'x'.repeat(1000), tokens: 1 }]);
      if (i % 50 !== 49) continue;
      await new Promise((resolve) => setImmediate(resolve));
      if ((await h.value('sluice_gateway_slow_clients_total')) > 0) break;
    }
    await expect.poll(() => h.value('sluice_gateway_slow_clients_total', { cause: 'buffer' }), { timeout: 10_000 }).toBe(1);
    expect(await h.value('sluice_gateway_request_outcomes_total', { outcome: 'slow_client' })).toBe(1);
    // Detached, not cancelled: the work goes on for a resume...
    expect(h.cancels).toEqual([]);
    // ...so it keeps its slot for the grace and its whole reservation (both used to be released).
    await new Promise((resolve) => setTimeout(resolve, 200));
    const [seconds, micros] = await redis.time();
    const score = await redis.zscore(limiter.keys(hash)[4]!, requestId);
    expect(score).not.toBeNull();
    const left = Number(score) - (Number(seconds) * 1000 + Math.floor(Number(micros) / 1000));
    expect(left).toBeGreaterThan(GRACE_MS - 5_000);
    expect(left).toBeLessThanOrEqual(GRACE_MS + 1_000);
    expect(await limiter.tokensInWindow(hash)).toBe(reserved);
    const another = await fetch(`${h.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${key}` },
      body: JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true }),
    });
    expect(another.status).toBe(429);
    expect(((await another.json()) as { error: { message: string } }).error.message).toMatch(/max-streams/);
    client.destroy();
  });
});
