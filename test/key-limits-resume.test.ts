import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createKey } from './support/api-keys.js';
import { Cluster, MODEL } from './support/cluster.js';
import { freezeMidAnswers, retryMidAnswer, thaw } from './support/mid-answer.js';
import { sleep, waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import { collect, empty, read, type Collected } from './support/sse.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { hashApiKey } from '../apps/gateway/src/auth/api-key.js';

/**
 * A key's `--max-streams` and `--tpm` hold across everything that moves a stream without stopping its
 * work: a resume on the same gateway while the old connection is still open (takeover), a resume on
 * another gateway with the old connection closing afterwards, and a gateway that drains with a
 * resumable stream open. Each used to free the stream slot (and, for the takeover and the drain,
 * refund the token reservation) while the generation ran on, so a max-streams=2 key ran 5
 * generations. Real redis-server, three gateways (AUTH=keys), one worker (tiny model) frozen with
 * SIGSTOP mid-answer, keys from the `keys` command.
 */

const MAX_TOKENS = 1500;
const TPM = 100_000;

describe('a key’s limits across resumes and drains', () => {
  let cluster: Cluster;
  let redis: Redis;
  let worker: WorkerProcess;
  let gateways: GatewayProcess[];
  const env = { AUTH: 'keys', HEADERS_WAIT_MS: '200' };

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the worker is frozen mid-answer below, and must not look lost meanwhile.
    worker = await cluster.worker({ WORKER_TTL_MS: '60000' });
    gateways = await Promise.all([cluster.gateway(env), cluster.gateway(env)]);
    redis = cluster.redis.client();
  }, 180_000);

  afterAll(async () => {
    thaw([worker]);
    redis?.disconnect();
    await cluster?.stop();
  });

  const limitKeys = (key: string) => {
    const base = `sluice:ratelimit:{${hashApiKey(key)}}`;
    return { streams: `${base}:streams`, tokens: `${base}:token-total`, tokenOwners: `${base}:token-owners` };
  };
  const post = (gateway: GatewayProcess, key: string, body: Record<string, unknown>, signal?: AbortSignal) =>
    fetch(`${gateway.url}/v1/chat/completions`, {
      method: 'POST',
      ...(signal === undefined ? {} : { signal }),
      headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${key}` },
      body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'Tell a long story.' }], temperature: 0, ...body }),
    });
  const resume = (gateway: GatewayProcess, key: string, stream: Collected) =>
    fetch(`${gateway.url}/v1/chat/completions/${stream.id}?stream=true`, {
      headers: { Authorization: `Bearer ${key}`, 'Last-Event-ID': stream.lastEventId! },
    });
  /** A new stream of `key`: its status (the stream itself is dropped). */
  const newStream = async (gateway: GatewayProcess, key: string) => {
    const res = await post(gateway, key, { max_tokens: 2, stream: true });
    if (res.status === 429) expect(((await res.json()) as { error: { message: string } }).error.message).toMatch(/max-streams/);
    else await res.body?.cancel();
    return res.status;
  };
  /** ms until the request's slot lapses, on Redis's clock (undefined: no slot). */
  const slotLeft = async (key: string, jobId: string) => {
    const [score, [seconds, micros]] = await Promise.all([redis.zscore(limitKeys(key).streams, jobId), redis.time()]);
    return score === null ? undefined : Number(score) - (Number(seconds) * 1000 + Math.floor(Number(micros) / 1000));
  };
  const tokensInWindow = async (key: string) => Number((await redis.get(limitKeys(key).tokens)) ?? 0);

  /**
   * A stream of `key` on `gateway` with a resume grace, some text read, the worker frozen with the
   * answer unfinished. Returns the open reply (and how to close it), what was read, its job id and its
   * token reservation.
   */
  const frozenMidAnswer = (gateway: GatewayProcess, key: string, graceMs: number) =>
    retryMidAnswer('the stream', async () => {
      const connection = new AbortController();
      const res = await post(
        gateway,
        key,
        { max_tokens: MAX_TOKENS, ignore_eos: true, stream: true, resume_grace_ms: graceMs },
        connection.signal,
      );
      expect(res.status).toBe(200);
      const reserved = TPM - Number(res.headers.get('x-ratelimit-remaining-tokens'));
      const before = empty();
      await read(res, before, (r) => r.text.length > 10);
      const jobId = before.id!.replace(/^chatcmpl-/, '');
      if ((await freezeMidAnswers([worker], redis, [{ jobId }], MAX_TOKENS)) !== null) {
        return { res, close: () => connection.abort(), before, jobId, reserved };
      }
      // It ended first (a starved machine): once its slot is free, try again.
      await read(res, before);
      await waitFor('the slot free', async () => ((await redis.zcard(limitKeys(key).streams)) === 0 ? true : undefined));
      return undefined;
    });

  /** The resumed stream runs to its end once the worker is thawed; then the key may stream again. */
  const finishAndStreamAgain = async (resumed: Response, key: string) => {
    thaw([worker]);
    const after = await collect(resumed);
    expect(after.errors).toEqual([]);
    expect(after.finishReasons[0]).toBe('length');
    await waitFor('the slot freed by the resumed stream’s end', async () =>
      (await newStream(gateways[0]!, key)) === 200 ? true : undefined,
    );
  };

  it('keeps the slot and the reservation of a stream resumed on the same gateway while its old connection is open (takeover)', async () => {
    const key = await createKey(cluster.redis.url, ['--name', 'takeover', '--max-streams', '1', '--tpm', String(TPM)]);
    const [g0] = gateways as [GatewayProcess];
    const metricsBefore = await scrapePrometheus(`${g0.url}/metrics`);
    const { res: first, before, jobId, reserved } = await frozenMidAnswer(g0, key, 60_000);
    try {
      const resumed = await resume(g0, key, before);
      expect(resumed.status).toBe(200);
      // The old connection is told, with an error frame, that another connection has its stream.
      await read(first, before);
      expect(before.errors).toMatchObject([{ code: 'stream_interrupted' }]);
      expect(before.done).toBe(true);
      // Time for a late release of the old delivery to land (it used to free the slot here).
      await sleep(500);
      expect(await newStream(gateways[1]!, key)).toBe(429);
      expect(await newStream(g0, key)).toBe(429);
      expect(await slotLeft(key, jobId)).toBeGreaterThan(120_000);
      // The generation goes on: its whole reservation stays (it used to be settled to the tokens so far).
      expect(await tokensInWindow(key)).toBe(reserved);
      // A takeover is no error: counted as detached (the work goes on), not as stream_interrupted.
      const metrics = await scrapePrometheus(`${g0.url}/metrics`);
      const delta = (name: string, labels: Record<string, string>) => metrics.value(name, labels) - metricsBefore.value(name, labels);
      expect(delta('sluice_gateway_request_outcomes_total', { outcome: 'detached' })).toBe(1);
      expect(delta('sluice_gateway_request_outcomes_total', { outcome: 'error' })).toBe(0);
      expect(delta('sluice_gateway_stream_errors_total', { code: 'stream_interrupted' })).toBe(0);
      await finishAndStreamAgain(resumed, key);
    } finally {
      thaw([worker]);
    }
  });

  it('keeps the slot of a stream resumed on another gateway when its old connection closes afterwards', async () => {
    const key = await createKey(cluster.redis.url, ['--name', 'moved', '--max-streams', '1', '--tpm', String(TPM)]);
    const [g0, g1] = gateways as [GatewayProcess, GatewayProcess];
    // A short grace: the old connection's detach used to re-score the slot to grace + 1 s from its close.
    const graceMs = 500;
    const { before, jobId, close } = await frozenMidAnswer(g0, key, graceMs);
    try {
      const resumed = await resume(g1, key, before);
      expect(resumed.status).toBe(200);
      await waitFor('the resumed stream holding the slot', async () => (((await slotLeft(key, jobId)) ?? 0) > 120_000 ? true : undefined));
      close();
      // Past the old connection's grace and slack: the generation still runs (frozen), so its slot stays.
      await sleep(graceMs + 1_000 + 1_000);
      expect(await newStream(g0, key)).toBe(429);
      expect(await newStream(g1, key)).toBe(429);
      expect(await slotLeft(key, jobId)).toBeGreaterThan(120_000);
      await finishAndStreamAgain(resumed, key);
    } finally {
      thaw([worker]);
    }
  });

  it('answers a resume whose attach fails 503, and holds its slot no longer than the grace', async () => {
    const key = await createKey(cluster.redis.url, ['--name', 'attach-failed', '--max-streams', '1', '--tpm', String(TPM)]);
    const [g0, g1] = gateways as [GatewayProcess, GatewayProcess];
    const graceMs = 3_000;
    const { before, jobId, close } = await frozenMidAnswer(g0, key, graceMs);
    try {
      close();
      await waitFor('the stream detached', async () => (((await slotLeft(key, jobId)) ?? Infinity) <= graceMs + 1_000 ? true : undefined));
      const tokenOwner = await redis.hget(limitKeys(key).tokenOwners, jobId);
      expect(tokenOwner).toBeTruthy();
      // Redis refuses PUBLISH for a moment: the attach (route script, then a publish) fails.
      await redis.call('ACL', 'SETUSER', 'default', '-publish');
      let res: Response;
      try {
        res = await resume(g1, key, before);
      } finally {
        await redis.call('ACL', 'SETUSER', 'default', '+publish');
      }
      // The reply starts once the route moved: a failed move is an honest 503 (it was a 200 with an
      // error frame; before that, a stream that stayed open with nothing to feed it, its slot claimed
      // to the request's deadline, ~10 min).
      expect(res.status).toBe(503);
      expect(res.headers.get('retry-after')).toBeTruthy();
      expect(await res.json()).toMatchObject({ error: { code: 'store_unavailable' } });
      // The slot is held for the grace only (the first delivery's detach): looked at until it is, for a
      // few seconds (it used to stay at the request's deadline).
      await waitFor(
        'the slot held for the grace only',
        async () => (((await slotLeft(key, jobId)) ?? Infinity) <= graceMs + 1_000 ? true : undefined),
        5_000,
      );
      const metrics = await scrapePrometheus(`${g1.url}/metrics`);
      expect(metrics.value('sluice_gateway_active_resumed_streams')).toBe(0);
      // Nothing was taken over: the token reservation is still the first delivery's to settle.
      expect(await redis.hget(limitKeys(key).tokenOwners, jobId)).toBe(tokenOwner);
    } finally {
      thaw([worker]);
    }
    // Nobody resumed it within its grace: the work is cancelled and the slot lapses.
    await waitFor('the key streaming again', async () => ((await newStream(g0, key)) === 200 ? true : undefined), 30_000);
  });

  it('keeps the slot and the reservation of a stream that a draining gateway detached, until its resume ends', async () => {
    const key = await createKey(cluster.redis.url, ['--name', 'drained', '--max-streams', '1', '--tpm', String(TPM)]);
    const draining = await cluster.gateway({ ...env, DRAIN_TIMEOUT_MS: '300' });
    const graceMs = 60_000;
    const { res: first, before, jobId, reserved } = await frozenMidAnswer(draining, key, graceMs);
    try {
      draining.process.signal('SIGTERM');
      await read(first, before);
      expect(before.errors).toMatchObject([{ code: 'shutting_down' }]);
      expect(await draining.process.exited).toEqual({ code: 0, signal: null });
      // Detached for a resume elsewhere: held for its grace, its reservation whole (both used to be released).
      expect(await newStream(gateways[0]!, key)).toBe(429);
      const left = (await slotLeft(key, jobId))!;
      expect(left).toBeGreaterThan(graceMs - 10_000);
      expect(left).toBeLessThanOrEqual(graceMs + 1_000);
      expect(await tokensInWindow(key)).toBe(reserved);
      const resumed = await resume(gateways[1]!, key, before);
      expect(resumed.status).toBe(200);
      await waitFor('the resumed stream holding the slot', async () => (((await slotLeft(key, jobId)) ?? 0) > 120_000 ? true : undefined));
      await finishAndStreamAgain(resumed, key);
    } finally {
      thaw([worker]);
    }
  });
});
