import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { redisNames } from '@sluice/protocol';
import { runKeys } from './support/api-keys.js';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep, waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import { startRedis, type RedisServer } from './support/redis-server.js';
import type { GatewayProcess } from './support/sluice.js';
import { freezeMidAnswers, retryMidAnswer, startFrozenMidAnswers } from './support/mid-answer.js';
import { checkChunkSequence, LiveStream, postRaw, streamError } from './support/sse.js';
import { loggedAnswer } from './support/token-log.js';

/**
 * Redis killed (SIGKILL) and restarted empty on the same port while streams run. Timings are
 * printed, not asserted (shared 2-core machine); the bounds below are generous and structural: every
 * stream ends, nothing hangs, the gateway says ready only when it is, and a request then succeeds.
 */
describe('when Redis is killed and restarted under load', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let restarted: RedisServer | undefined;

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker();
    gateway = await cluster.gateway();
  });

  afterAll(async () => {
    await Promise.all([...cluster.gateways, ...cluster.workers].map((p) => p.process.stop(3_000)));
    await restarted?.stop();
    await cluster.redis.stop();
  });

  const body = { model: MODEL, prompt: 'Once upon a time', max_tokens: 1000, ignore_eos: true, temperature: 0, stream: true };

  /**
   * Eight streams under way, the worker then frozen (SIGSTOP) with the last one unfinished in its token
   * log (see mid-answer.ts; else they run on and eight new ones try): the caller kills Redis, then thaws it.
   */
  async function startStreams(): Promise<{ streams: LiveStream[]; ends: Array<Promise<number>> }> {
    const worker = cluster.workers[0]!;
    const redis = (restarted ?? cluster.redis).client();
    try {
      return await retryMidAnswer('the last stream', async () => {
        const streams = Array.from({ length: 8 }, () => new LiveStream(`${gateway.url}/v1/completions`, body));
        for (const stream of streams) {
          await stream
            .until('streaming', () => stream.contentChunks > 0)
            .catch((error: unknown) => {
              throw new Error(`${String(error)}: ${stream.status} ${JSON.stringify(stream.items.slice(-3))}`);
            });
        }
        if ((await freezeMidAnswers([worker], redis, [streams.at(-1)!], body.max_tokens)) !== null) {
          return { streams, ends: streams.map((stream) => stream.ended.then(() => Date.now())) };
        }
        for (const stream of streams) stream.abort();
        await Promise.all(streams.map((stream) => stream.ended));
        return undefined;
      });
    } finally {
      redis.disconnect();
    }
  }

  /**
   * Each stream ends with [DONE], never silently: with an error frame (the answer cannot be completed)
   * when it was still running at the kill. A stream can finish its 1,000 tokens before the kill when the
   * machine delays the others' start (the tiny model needs ~1.5 s for them): that one ends complete.
   * At least the last stream to start was still running (startStreams checked its log).
   */
  function expectEndedByTheOutage(streams: readonly LiveStream[]): void {
    const outcomes = streams.map((stream) => {
      const tail = `${stream.status} ${JSON.stringify(stream.items.slice(-3))}`;
      expect(stream.items.at(-1), tail).toMatchObject({ kind: 'data', data: '[DONE]' });
      const code = streamError(stream.items)?.code;
      if (code !== undefined) return code;
      const last = stream.items.findLast((item) => item.kind === 'data' && item.data !== '[DONE]');
      const finish =
        last?.kind === 'data'
          ? (JSON.parse(last.data) as { choices: Array<{ finish_reason: unknown }> }).choices[0]?.finish_reason
          : undefined;
      expect(finish, tail).toBe('length');
      return 'length';
    });
    for (const outcome of outcomes) expect(outcome).toMatch(/^(stream_interrupted|worker_lost|length)$/);
    expect(outcomes.filter((outcome) => outcome !== 'length').length, outcomes.join(' ')).toBeGreaterThan(0);
  }

  /** Kills Redis, then thaws the worker that startStreams froze. */
  async function killRedis(): Promise<number> {
    const current = restarted ?? cluster.redis;
    current.process.signal('SIGKILL');
    await current.process.exited;
    const killedAt = Date.now();
    cluster.workers[0]!.process.signal('SIGCONT');
    return killedAt;
  }

  it('ends every in-flight stream, turns ready again, and serves the next request', async () => {
    const { streams, ends } = await startStreams();
    const killedAt = await killRedis();
    await sleep(1_000);
    restarted = await startRedis({ port: cluster.redis.port });
    const backAt = Date.now();

    const endedAt = await Promise.race([Promise.all(ends), sleep(30_000).then(() => undefined)]);
    expect(endedAt, 'every stream ended').toBeDefined();
    expectEndedByTheOutage(streams);
    // The worker stopped decoding for nobody: its sequences' entries could not be written.
    await waitFor('worker idle', async () => ((await cluster.workers[0]!.health()).running === 0 ? true : undefined), 30_000, 50);
    const idleAt = Date.now();
    const readyAt = await waitFor(
      '/readyz 200',
      async () => ((await gateway.get('/readyz')).status === 200 ? Date.now() : undefined),
      30_000,
      50,
    );
    const sentAt = Date.now();
    const next = await postRaw(`${gateway.url}/v1/completions`, { model: MODEL, prompt: 'Hello', max_tokens: 4, temperature: 0 });
    const answeredAt = Date.now();
    expect(next.status).toBe(200);
    console.log(
      `redis restart: streams ended ${Math.max(...endedAt!) - backAt} ms after Redis returned (${Math.max(...endedAt!) - killedAt} ms after the kill); ` +
        `worker idle ${idleAt - backAt} ms after; /readyz 200 after ${readyAt - backAt} ms; first request answered in ${answeredAt - sentAt} ms (${answeredAt - backAt} ms after Redis returned)`,
    );
  });

  it('ends the streams while Redis is still away when the outage outlasts a reconnect', async () => {
    const { streams, ends } = await startStreams();
    const killedAt = await killRedis();
    const endedAt = await Promise.race([Promise.all(ends), sleep(30_000).then(() => undefined)]);
    expect(endedAt, 'every stream ended with Redis still down').toBeDefined();
    expectEndedByTheOutage(streams);
    expect((await gateway.get('/readyz')).status).toBe(503);
    // What pages while no request comes in (deploy/prometheus/alerts.yml, SluiceNoReadyGateway).
    expect((await scrapePrometheus(`${gateway.url}/metrics`)).value('sluice_gateway_ready')).toBe(0);
    // A request meanwhile is refused for what it is: Redis away, not a missing worker.
    const refused = await postRaw(`${gateway.url}/v1/completions`, { model: MODEL, prompt: 'Hello', max_tokens: 4 });
    expect(refused.status).toBe(503);
    expect(refused.json).toMatchObject({ error: { code: 'store_unavailable', type: 'server_error' } });
    expect(refused.headers.get('retry-after')).toMatch(/^\d+$/);
    // So are a resume and a cancel of a stream (they were a 500 `internal`).
    const id = `cmpl-${streams[0]!.jobId}`;
    const resumed = await fetch(`${gateway.url}/v1/completions/${id}?stream=true`, { headers: { 'Last-Event-ID': '0' } });
    const cancelled = await fetch(`${gateway.url}/v1/completions/${id}/cancel`, { method: 'POST' });
    for (const res of [resumed, cancelled]) {
      expect(res.status).toBe(503);
      expect(await res.json()).toMatchObject({ error: { code: 'store_unavailable', type: 'server_error' } });
      expect(res.headers.get('retry-after')).toMatch(/^\d+$/);
    }
    console.log(`redis down: streams ended ${Math.max(...endedAt!) - killedAt} ms after the kill, Redis still away`);
    restarted = await startRedis({ port: cluster.redis.port });
    await waitFor('/readyz 200', async () => ((await gateway.get('/readyz')).status === 200 ? true : undefined), 30_000, 50);
    expect((await scrapePrometheus(`${gateway.url}/metrics`)).value('sluice_gateway_ready')).toBe(1);
    const next = await postRaw(`${gateway.url}/v1/completions`, { model: MODEL, prompt: 'Hello', max_tokens: 4, temperature: 0 });
    expect(next.status).toBe(200);
  });
});

/**
 * Redis with persistence (an append-only file, every write synced) killed while a worker writes its
 * streams' steps, and restarted from its data: the tokens logged before the kill are still there, the
 * ones written meanwhile are lost. The worker stops those requests (it cannot write them), and once
 * Redis answers again it hands each one over: a new attempt continues it from its log, token-identical,
 * and the gateway's open stream goes on to the whole answer. (They used to end with `worker_lost` or,
 * when that entry was lost too, stay silent until IDLE_TIMEOUT_MS.) The gateway is stopped (SIGSTOP)
 * through the outage, so that its own outage bound does not end the streams first (tested above).
 */
describe('when Redis with persistence is killed mid-answer and restarted from its data', () => {
  const dir = mkdtempSync(join(tmpdir(), 'sluice-aof-'));
  let cluster: Cluster;
  let restarted: RedisServer | undefined;
  const body = { model: MODEL, max_tokens: 600, ignore_eos: true, temperature: 0, stream: true };
  const prompts = ['Once upon a time', 'The river', 'A lighthouse keeper', 'In the city'];

  beforeAll(async () => {
    cluster = await Cluster.start({ appendOnlyDir: dir });
    // A long TTL: the frozen worker is not taken for lost (a gateway would then move its streams itself).
    await cluster.worker({ WORKER_TTL_MS: '60000', LOG_LEVEL: 'info' });
    await cluster.gateway();
  });

  afterAll(async () => {
    for (const p of [...cluster.gateways, ...cluster.workers]) p.process.signal('SIGCONT');
    await Promise.all([...cluster.gateways, ...cluster.workers].map((p) => p.process.stop(3_000)));
    await restarted?.stop();
    await cluster.redis.stop();
    rmSync(dir, { recursive: true, force: true });
  });

  it("continues each stream on a new attempt once Redis is back: the client gets the whole answer, the uninterrupted one's text", async () => {
    const worker = cluster.workers[0]!;
    const gateway = cluster.gateways[0]!;
    // The uninterrupted answers, each alone.
    const references: string[] = [];
    for (const prompt of prompts) {
      const reference = new LiveStream(`${gateway.url}/v1/completions`, { ...body, prompt });
      await reference.ended;
      references.push(checkChunkSequence(reference.items, 'completion', false).text);
    }
    const redis = cluster.redis.client();
    let streams: LiveStream[];
    try {
      ({ streams } = await startFrozenMidAnswers([worker], redis, {
        start: () => prompts.map((prompt) => new LiveStream(`${gateway.url}/v1/completions`, { ...body, prompt })),
        progress: (stream) => stream.until('streaming', () => stream.contentChunks > 0),
        maxTokens: body.max_tokens,
      }));
    } finally {
      redis.disconnect();
    }
    gateway.process.signal('SIGSTOP');
    try {
      cluster.redis.process.signal('SIGKILL');
      await cluster.redis.process.exited;
      // Thawed with Redis away, the worker cannot write its next step: it stops those requests.
      worker.process.signal('SIGCONT');
      await waitFor('the worker losing a step', () =>
        worker.process.output().includes('"abortReason":"redis_unavailable"') ? true : undefined,
      );
      restarted = await startRedis({ port: cluster.redis.port, appendOnlyDir: dir });
    } finally {
      gateway.process.signal('SIGCONT');
    }
    const ended = await Promise.race([Promise.all(streams.map((stream) => stream.ended)), sleep(60_000).then(() => undefined)]);
    expect(ended, 'every stream ended').toBeDefined();
    const check = restarted.client();
    try {
      for (const [i, stream] of streams.entries()) {
        // No error frame, one finish, [DONE]: the whole answer, as the uninterrupted run wrote it.
        const answer = checkChunkSequence(stream.items, 'completion', false);
        expect(answer.finishReason).toBe('length');
        expect(answer.text).toBe(references[i]);
        expect(answer.text).toBe((await loggedAnswer(check, stream.jobId)).text);
      }
      const attempts = await Promise.all(
        streams.map(async (stream) => Number(await check.hget(redisNames().metaKey(stream.jobId), 'attempt'))),
      );
      expect(Math.max(...attempts), 'a stream the worker handed over').toBeGreaterThan(1);
    } finally {
      check.disconnect();
    }
    expect(worker.process.output()).toContain('handed over after a Redis outage');
  });
});

/**
 * Redis refusing writes (`maxmemory` reached, `noeviction`) while streams run: PUBLISH still works, so
 * the live path carries on while the token logs miss those steps. The worker keeps its streams going
 * (a refused append is Redis's answer on a sound connection); only a connection that fails under a
 * write makes it stop and hand the request over (above).
 */
describe('when Redis refuses writes (out of memory) mid-answer', () => {
  let cluster: Cluster;
  const body = { model: MODEL, prompt: 'Once upon a time', max_tokens: 400, ignore_eos: true, temperature: 0, stream: true };

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: its heartbeats are refused too while Redis is full.
    await cluster.worker({ WORKER_TTL_MS: '60000' });
    await cluster.gateway();
  });

  afterAll(async () => {
    cluster.workers[0]?.process.signal('SIGCONT');
    await cluster?.stop();
  });

  it('delivers the whole answer live', async () => {
    const worker = cluster.workers[0]!;
    const gateway = cluster.gateways[0]!;
    const reference = new LiveStream(`${gateway.url}/v1/completions`, body);
    await reference.ended;
    const expected = checkChunkSequence(reference.items, 'completion', false).text;
    const redis = cluster.redis.client();
    try {
      const { streams } = await startFrozenMidAnswers([worker], redis, {
        start: () => [new LiveStream(`${gateway.url}/v1/completions`, body)],
        progress: (stream) => stream.until('streaming', () => stream.contentChunks > 0),
        maxTokens: body.max_tokens,
      });
      await redis.config('SET', 'maxmemory', '1');
      try {
        worker.process.signal('SIGCONT');
        await waitFor('an append refused', () => (worker.process.output().includes('OOM') ? true : undefined));
        expect(await streams[0]!.ended).toBe('done');
      } finally {
        await redis.config('SET', 'maxmemory', '0');
      }
      const answer = checkChunkSequence(streams[0]!.items, 'completion', false);
      expect(answer.finishReason).toBe('length');
      expect(answer.text).toBe(expected);
    } finally {
      redis.disconnect();
    }
  });
});

/**
 * The key a gateway stores from API_KEY at start is stored again when Redis comes back without its
 * data (it was a 401 for every request until the gateways restarted), but not after a mere reconnect
 * to the same Redis, where a revoke of it must hold.
 */
describe('when Redis restarts without its data, behind gateways started with API_KEY', () => {
  let cluster: Cluster;
  let restarted: RedisServer | undefined;
  const apiKey = `sk-${'0123456789abcdef'.repeat(3)}`;

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker();
    await cluster.gateway({ AUTH: 'keys', API_KEY: apiKey, API_KEY_NAME: 'deployed' });
  });

  afterAll(async () => {
    await Promise.all([...cluster.gateways, ...cluster.workers].map((p) => p.process.stop(3_000)));
    await restarted?.stop();
    await cluster.redis.stop();
  });

  const status = async () =>
    (
      await fetch(`${cluster.gateways[0]!.url}/v1/completions`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${apiKey}` },
        body: JSON.stringify({ model: MODEL, prompt: 'Hello', max_tokens: 2 }),
      })
    ).status;

  it('stores the key again, and a revoke of it then holds through a reconnect', async () => {
    expect(await status()).toBe(200);
    cluster.redis.process.signal('SIGKILL');
    await cluster.redis.process.exited;
    restarted = await startRedis({ port: cluster.redis.port });
    // Once the worker registered again (it was a 401 from here on).
    await waitFor('the key accepted again', async () => ((await status()) === 200 ? true : undefined), 30_000, 100);

    const revoked = await runKeys(restarted.url, ['revoke', '--name', 'deployed']);
    expect(revoked.code, revoked.stderr).toBe(0);
    expect(await status()).toBe(401);
    // Every client's connection cut: the gateway reconnects to the same Redis, and stores nothing.
    const admin = restarted.client();
    try {
      await admin.call('CLIENT', 'KILL', 'TYPE', 'normal', 'SKIPME', 'yes');
    } finally {
      admin.disconnect();
    }
    await waitFor('/readyz 200', async () => ((await cluster.gateways[0]!.get('/readyz')).status === 200 ? true : undefined), 30_000, 50);
    await sleep(200);
    expect(await status()).toBe(401);
  });
});
