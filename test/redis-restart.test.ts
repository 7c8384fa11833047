import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep, waitFor } from './support/processes.js';
import { startRedis, type RedisServer } from './support/redis-server.js';
import type { GatewayProcess } from './support/sluice.js';
import { freezeMidAnswers, retryMidAnswer } from './support/mid-answer.js';
import { LiveStream, postRaw, streamError } from './support/sse.js';

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
    // A request meanwhile is refused for what it is: Redis away, not a missing worker.
    const refused = await postRaw(`${gateway.url}/v1/completions`, { model: MODEL, prompt: 'Hello', max_tokens: 4 });
    expect(refused.status).toBe(503);
    expect(refused.json).toMatchObject({ error: { code: 'store_unavailable', type: 'server_error' } });
    expect(refused.headers.get('retry-after')).toMatch(/^\d+$/);
    console.log(`redis down: streams ended ${Math.max(...endedAt!) - killedAt} ms after the kill, Redis still away`);
    restarted = await startRedis({ port: cluster.redis.port });
    await waitFor('/readyz 200', async () => ((await gateway.get('/readyz')).status === 200 ? true : undefined), 30_000, 50);
    const next = await postRaw(`${gateway.url}/v1/completions`, { model: MODEL, prompt: 'Hello', max_tokens: 4, temperature: 0 });
    expect(next.status).toBe(200);
  });
});
