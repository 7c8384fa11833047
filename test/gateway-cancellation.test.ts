import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep, waitFor } from './support/processes.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { scrapePrometheus } from './support/prometheus.js';
import { checkChunkSequence, LiveStream, postRaw } from './support/sse.js';

const long = (prompt: string) => ({ model: MODEL, prompt, max_tokens: 1800, ignore_eos: true, temperature: 0, stream: true });
// Long enough (~1 s on an idle machine, more under load) that it is still running when the test reads
// the worker's running count, and again when the doomed stream is cut.
const steady = { model: MODEL, prompt: 'The other stream', max_tokens: 1000, ignore_eos: true, temperature: 0, stream: true };

describe('when the client goes away', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let worker: WorkerProcess;
  let steadyAlone: string;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A small step budget: a long prompt takes ~475 prefill steps (a few hundred ms), a window to leave in.
    worker = await cluster.worker({ MAX_BATCH_SIZE: '2', MAX_STEP_TOKENS: '4' });
    gateway = await cluster.gateway();
    steadyAlone = checkChunkSequence((await postRaw(`${gateway.url}/v1/completions`, steady)).items, 'completion', false).text;
  });

  afterAll(async () => {
    await cluster?.stop();
  });

  it('mid-stream: the sequence leaves the batch within a step, other streams are unaffected', async () => {
    const doomed = new LiveStream(`${gateway.url}/v1/completions`, long('A story that will be cut'));
    await doomed.until('a few chunks', () => doomed.contentChunks >= 3);
    const other = new LiveStream(`${gateway.url}/v1/completions`, steady);
    await other.until('the other stream started', () => other.contentChunks >= 1);
    expect((await worker.health()).running).toBe(2);

    const abortedAt = Date.now();
    doomed.abort();
    const after = await waitFor(
      'the running count to drop',
      async () => {
        const health = await worker.health();
        return health.running <= 1 && health.lastCancel?.requestId === doomed.requestId ? health : undefined;
      },
      10_000,
      5,
    );
    // The engine drops an aborted sequence at the next step boundary (packages/engine tests count the
    // tokens); here a step is well under a millisecond, so the cancel is bounded by the message path.
    expect(after.lastCancel!.ms).toBeLessThan(500);
    expect(Date.now() - abortedAt).toBeLessThan(2_000);

    expect(await other.ended).toBe('done');
    expect(checkChunkSequence(other.items, 'completion', false).text).toBe(steadyAlone);
    await waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
  });

  it('during prefill: the sequence is cancelled before its first token, counted as a prefill disconnect', async () => {
    await waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
    const metrics = await scrapePrometheus(`${gateway.url}/metrics`);
    const before = metrics.value('sluice_gateway_disconnects_total', { stage: 'prefill' });
    const scheduledBefore = metrics.histogram('sluice_request_queue_time_seconds').count;
    // 1,900 prompt tokens at 4 per step: the engine schedules it (its queue time ends), then prefills for ~475 steps.
    const promptIds = Array.from({ length: 1900 }, (_, i) => 100 + (i % 500));
    const stream = new LiveStream(`${gateway.url}/v1/completions`, {
      model: MODEL,
      prompt: promptIds,
      max_tokens: 8,
      temperature: 0,
      stream: true,
    });
    expect(await stream.headers).toBe(200);
    await waitFor('the engine scheduled it', async () =>
      (await scrapePrometheus(`${gateway.url}/metrics`)).histogram('sluice_request_queue_time_seconds').count > scheduledBefore
        ? true
        : undefined,
    );
    // Frozen mid-prefill, so the client leaves before any token whatever the machine's speed.
    worker.process.signal('SIGSTOP');
    try {
      expect(stream.contentChunks).toBe(0);
      stream.abort();
      expect(await stream.ended).toBe('aborted');
      await waitFor(
        'the gateway counted the disconnect',
        async () => {
          const now = (await scrapePrometheus(`${gateway.url}/metrics`)).value('sluice_gateway_disconnects_total', { stage: 'prefill' });
          return now === before + 1 ? true : undefined;
        },
        5_000,
      );
    } finally {
      worker.process.signal('SIGCONT');
    }
    await worker.sequenceCancelled(stream.requestId);
  });

  it('while queued: the waiting job is removed and never runs', async () => {
    const redis = cluster.redis.client();
    try {
      await waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
      await sleep(100);
      const start = await worker.health();
      const fillers = [
        new LiveStream(`${gateway.url}/v1/completions`, long('Filler one')),
        new LiveStream(`${gateway.url}/v1/completions`, long('Filler two')),
      ];
      await Promise.all(fillers.map((s) => s.until('filler running', () => s.contentChunks >= 1)));
      // Both batch slots are busy, and frozen so the fillers cannot finish first on a fast machine:
      // this one waits in the queue.
      worker.process.signal('SIGSTOP');
      try {
        const queued = new LiveStream(`${gateway.url}/v1/chat/completions`, {
          model: MODEL,
          messages: [{ role: 'user', content: 'I will not wait' }],
          max_tokens: 8,
          stream: true,
        });
        await waitFor('the job waiting in Redis', async () => ((await redis.llen('sluice:bull:generate:wait')) === 1 ? true : undefined));
        queued.abort();
        expect(await queued.ended).toBe('aborted');
        await waitFor(
          'the waiting job removed',
          async () => ((await redis.llen('sluice:bull:generate:wait')) === 0 ? true : undefined),
          5_000,
        );
      } finally {
        worker.process.signal('SIGCONT');
      }

      for (const filler of fillers) filler.abort();
      await waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
      await sleep(300);
      const end = await worker.health();
      // Only the two fillers ran; the queued job neither ran nor was even taken.
      expect(end.processed - start.processed).toBe(2);
      expect(end.skipped - start.skipped).toBe(0);
      expect(await redis.keys('sluice:bull:generate:[0-9a-f]*-*')).toEqual([]);
    } finally {
      redis.disconnect();
    }
  });
});
