import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { decodeLogRange, redisNames } from '@sluice/protocol';
import { Cluster, MODEL } from './support/cluster.js';
import { waitFor } from './support/processes.js';
import { freezeMidAnswers } from './support/mid-answer.js';
import { scrapePrometheus, type PrometheusMetrics } from './support/prometheus.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { LiveStream, postRaw, streamError } from './support/sse.js';

/**
 * Admission sees the whole system: a request a worker took from the queue but whose engine has no
 * room for it yet (its one batch row is busy) is still waiting. Real redis-server, BullMQ, a worker
 * with the tiny model, a gateway; the worker is frozen (SIGSTOP) while the request waits, so nothing
 * races the model's speed.
 */

function dataEvents(stream: LiveStream): string[] {
  return stream.items.flatMap((item) => (item.kind === 'data' ? [item.data] : []));
}

/** Whether the request's token log holds an entry of the engine's: `scheduled`, a text delta or an end. */
async function reachedEngine(redis: Redis, jobId: string): Promise<boolean> {
  const log = decodeLogRange(await redis.xrange(redisNames().logKey(jobId), '-', '+'));
  return log.some((entry) => entry.type !== 'accepted');
}

describe('a request accepted by a worker but not scheduled by its engine', () => {
  let cluster: Cluster;
  let worker: WorkerProcess;
  let gateway: GatewayProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // One batch row but four jobs at a time: the worker accepts a second request that its engine
    // cannot take yet. A long TTL: a frozen worker is not "lost".
    worker = await cluster.worker({ MAX_BATCH_SIZE: '1', WORKER_CONCURRENCY: '4', WORKER_TTL_MS: '60000' });
    // The queue timeout leaves a starved machine time to freeze the worker and check the logs first.
    gateway = await cluster.gateway({ QUEUE_TIMEOUT_MS: '5000', MAX_QUEUED_REQUESTS: '1', HEARTBEAT_MS: '200' });
  }, 120_000);

  afterAll(async () => {
    worker?.process.signal('SIGCONT');
    await cluster?.stop();
  });

  const FILLER = { model: MODEL, prompt: 'Filler', max_tokens: 1800, ignore_eos: true, temperature: 0, stream: true };

  /**
   * A filler in the engine's only row, a second request the worker accepted behind it, and the worker
   * frozen (SIGSTOP) with the filler unfinished in its token log and the other not scheduled (see
   * mid-answer.ts): the tiny model decodes 1,800 tokens in about a second, and a starved test could
   * freeze it after the filler ended and the other one ran. Else both are aborted and another pair
   * tries (5 tries). Returns them, the worker stopped, with the gateway's metrics from before the pair.
   */
  async function frozenBehindFiller(): Promise<{ before: PrometheusMetrics; filler: LiveStream; waiting: LiveStream }> {
    const redis = cluster.redis.client();
    try {
      for (let attempt = 1; attempt <= 5; attempt++) {
        // Nothing left of an earlier try: no stream open, nothing running or waiting in the worker.
        const before = await waitFor('gateway and worker idle', async () => {
          const [metrics, health] = await Promise.all([scrapePrometheus(`${gateway.url}/metrics`), worker.health()]);
          return metrics.value('sluice_gateway_active_streams') === 0 && health.running === 0 && health.waiting === 0 ? metrics : undefined;
        });
        const filler = new LiveStream(`${gateway.url}/v1/completions`, FILLER);
        await filler.until('filler running', () => filler.contentChunks >= 1);
        const waiting = new LiveStream(`${gateway.url}/v1/chat/completions`, {
          model: MODEL,
          messages: [{ role: 'user', content: 'Waiting' }],
          max_tokens: 8,
          stream: true,
        });
        // The role chunk goes out when the worker accepts the job.
        await waiting.until('accepted by the worker', () => dataEvents(waiting).length >= 1);
        const frozen = await freezeMidAnswers([worker], redis, [filler], FILLER.max_tokens);
        if (frozen !== null && !(await reachedEngine(redis, waiting.jobId))) return { before, filler, waiting };
        if (frozen !== null) worker.process.signal('SIGCONT');
        filler.abort();
        waiting.abort();
        await Promise.all([filler.ended, waiting.ended]);
      }
      throw new Error('in each of 5 tries the filler ended before the worker could be frozen with a request waiting behind it');
    } finally {
      redis.disconnect();
    }
  }

  it('is counted as queued (429 bound, queue time) and ended by the queue timeout, which cancels it inside the engine', async () => {
    const { before, filler, waiting } = await frozenBehindFiller();
    const queueTimes = before.histogram('sluice_request_queue_time_seconds').count;
    const queueTimeouts = before.value('sluice_gateway_timeouts_total', { kind: 'queue' });
    try {
      // The filler (1,800 tokens) still holds the engine's only row: the second request waits there.
      expect(await Promise.race([filler.ended, new Promise((resolve) => setTimeout(() => resolve('running'), 50))])).toBe('running');
      expect(waiting.contentChunks).toBe(0);
      // Counted as queued: with MAX_QUEUED_REQUESTS=1 a third request is refused before any byte.
      const third = await postRaw(`${gateway.url}/v1/chat/completions`, {
        model: MODEL,
        messages: [{ role: 'user', content: 'Third' }],
        max_tokens: 4,
        stream: true,
      });
      expect(third.status).toBe(429);
      expect(third.json).toMatchObject({ error: { code: 'queue_full' } });
      // The queue timeout runs while it waits inside the engine (the idle timeout does not apply).
      expect(await waiting.ended).toBe('done');
    } finally {
      worker.process.signal('SIGCONT');
    }
    expect(streamError(waiting.items)).toMatchObject({ code: 'queue_timeout' });
    expect(waiting.contentChunks).toBe(0);
    // The worker dropped it from its engine's queue (the cancel reached the job it holds).
    await waitFor('the worker cancelled the waiting request', async () =>
      (await worker.health()).lastCancel?.requestId === waiting.requestId ? true : undefined,
    );
    expect(await filler.ended).toBe('done');
    expect(streamError(filler.items)).toBeUndefined();

    const after = await scrapePrometheus(`${gateway.url}/metrics`);
    expect(after.value('sluice_gateway_timeouts_total', { kind: 'queue' }) - queueTimeouts).toBe(1);
    // Queue time is observed when an engine schedules a request: the filler's, not the one that never ran.
    expect(after.histogram('sluice_request_queue_time_seconds').count - queueTimes).toBe(1);
  }, 60_000);
});
