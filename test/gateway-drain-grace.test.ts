import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { freezeMidAnswers, retryMidAnswer, thaw } from './support/mid-answer.js';
import { waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import { collect, empty, read } from './support/sse.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * A gateway stopped (SIGTERM) with a stream that outlasts its drain bound: a stream with a resume
 * grace is detached, not cancelled, so its client resumes it on another gateway and gets the whole
 * answer, as after a crash of that gateway; it used to be cancelled (finish_reason abort on resume).
 * Real redis-server, two gateways, one worker (the tiny model), plain `fetch`.
 */

const MAX_TOKENS = 1500;
const body = (extra: Record<string, unknown> = {}) => ({
  model: MODEL,
  messages: [{ role: 'user', content: 'Tell a long story about a gateway that stops.' }],
  max_tokens: MAX_TOKENS,
  temperature: 0,
  ignore_eos: true,
  stream: true,
  ...extra,
});

describe('a gateway that stops with a resumable stream still open', () => {
  let cluster: Cluster;
  let redis: Redis;
  let worker: WorkerProcess;
  let stopping: GatewayProcess;
  let other: GatewayProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the worker is frozen below, and must not look lost meanwhile.
    worker = await cluster.worker({ WORKER_TTL_MS: '60000', MAX_BATCH_SIZE: '8' });
    [stopping, other] = await Promise.all([cluster.gateway({ DRAIN_TIMEOUT_MS: '1000' }), cluster.gateway()]);
    redis = cluster.redis.client();
  }, 120_000);

  afterAll(async () => {
    thaw([worker]);
    redis?.disconnect();
    await cluster?.stop();
  });

  it('detaches it at the drain bound: the client resumes it elsewhere and gets the whole answer', async () => {
    const post = (url: string, extra: Record<string, unknown> = {}) =>
      fetch(`${url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify(body(extra)),
      });
    const alone = await collect(await post(other.url));
    expect(alone.finishReasons[0]).toBe('length');

    // Mid-answer whatever the machine's speed: the worker frozen with the answer unfinished in its log.
    const { started, before, jobId } = await retryMidAnswer('the stream', async () => {
      const started = await post(stopping.url, { resume_grace_ms: 60_000 });
      expect(started.status).toBe(200);
      const before = empty();
      await read(started, before, (r) => r.text.length > 10);
      const jobId = before.id!.replace(/^chatcmpl-/, '');
      if ((await freezeMidAnswers([worker], redis, [{ jobId }], MAX_TOKENS)) !== null) return { started, before, jobId };
      await read(started, before);
      return undefined;
    });
    try {
      stopping.process.signal('SIGTERM');
      // The drain bound runs out with the stream open: it ends with an error frame that says it goes on.
      await read(started, before);
      expect(before.done).toBe(true);
      expect(before.errors).toHaveLength(1);
      expect(before.errors[0]).toMatchObject({ code: 'shutting_down', message: expect.stringContaining('resume') as unknown });
      expect(await stopping.process.exited).toEqual({ code: 0, signal: null });
      // Detached (its route cleared), not cancelled.
      await waitFor('the request detached', async () =>
        (await redis.hget(`sluice:{${jobId}}:meta`, 'channel')) === '' ? true : undefined,
      );
    } finally {
      thaw([worker]);
    }
    const resumed = await fetch(`${other.url}/v1/chat/completions/${before.id}?stream=true`, {
      headers: { 'Last-Event-ID': before.lastEventId! },
    });
    expect(resumed.status).toBe(200);
    const after = await collect(resumed);
    expect(after.errors).toEqual([]);
    expect(after.finishReasons[0]).toBe('length');
    expect(before.text + after.text).toBe(alone.text);
    // The tokens the resume wrote count where they were written: the run alone's MAX_TOKENS, and more.
    const written = (await scrapePrometheus(`${other.url}/metrics`)).value('sluice_gateway_stream_tokens_total');
    expect(written).toBeGreaterThan(MAX_TOKENS);
    expect(written).toBeLessThanOrEqual(2 * MAX_TOKENS);
  }, 120_000);
});
