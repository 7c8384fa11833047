import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep, waitFor } from './support/processes.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { freezeMidAnswers, startFrozenMidAnswers } from './support/mid-answer.js';
import { scrapePrometheus } from './support/prometheus.js';
import { checkChunkSequence, LiveStream, postRaw } from './support/sse.js';

const long = (prompt: string) => ({ model: MODEL, prompt, max_tokens: 1800, ignore_eos: true, temperature: 0, stream: true });
// Long enough (~1 s on an idle machine) to be frozen mid-answer next to the doomed one, and to go on after the cut.
const steady = { model: MODEL, prompt: 'The other stream', max_tokens: 1000, ignore_eos: true, temperature: 0, stream: true };

describe('when the client goes away', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let worker: WorkerProcess;
  let steadyAlone: string;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A small step budget: a long prompt takes ~475 prefill steps (a few hundred ms), a window to leave in.
    // A long TTL: a worker frozen (SIGSTOP) while a test acts is not "lost".
    worker = await cluster.worker({ MAX_BATCH_SIZE: '2', MAX_STEP_TOKENS: '4', WORKER_TTL_MS: '60000' });
    gateway = await cluster.gateway();
    steadyAlone = checkChunkSequence((await postRaw(`${gateway.url}/v1/completions`, steady)).items, 'completion', false).text;
  });

  afterAll(async () => {
    worker?.process.signal('SIGCONT');
    await cluster?.stop();
  });

  it('mid-stream: the sequence leaves the batch within a step, other streams are unaffected', async () => {
    const disconnects = async () =>
      (await scrapePrometheus(`${gateway.url}/metrics`)).value('sluice_gateway_disconnects_total', { stage: 'decode' });
    // Both in the batch, frozen mid-answer (see mid-answer.ts): each has content and its log no end (at
    // most 500 text deltas), so both hold a row. The tiny model decodes either in about a second, and a
    // starved test could look after one ended.
    const redis = cluster.redis.client();
    const [doomed, other] = await startFrozenMidAnswers([worker], redis, {
      start: () => [
        new LiveStream(`${gateway.url}/v1/completions`, long('A story that will be cut')),
        new LiveStream(`${gateway.url}/v1/completions`, steady),
      ],
      progress: (stream) => stream.until('a few chunks', () => stream.contentChunks >= 3),
      maxTokens: steady.max_tokens,
    })
      .then(({ streams }) => streams as [LiveStream, LiveStream])
      .finally(() => redis.disconnect());

    // Read with the streams frozen: disconnects of a failed try (aborted, see startFrozenMidAnswers) are in.
    const before = await disconnects();
    let thawedAt = 0;
    try {
      // The client leaves while the worker is frozen; the gateway counts it and sends the cancel, which
      // waits in the worker's socket: the time it takes to act is counted from the thaw.
      doomed.abort();
      expect(await doomed.ended).toBe('aborted');
      await waitFor('the gateway counted the disconnect', async () => ((await disconnects()) === before + 1 ? true : undefined), 5_000);
    } finally {
      worker.process.signal('SIGCONT');
      thawedAt = Date.now();
    }
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
    // Prompt, yet generous: a loaded machine's timers and polls run late.
    expect(Date.now() - thawedAt).toBeLessThan(5_000);

    expect(await other.ended).toBe('done');
    expect(checkChunkSequence(other.items, 'completion', false).text).toBe(steadyAlone);
    await waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
  });

  it('during prefill: the sequence is cancelled before its first token, counted as a prefill disconnect', async () => {
    // 1,900 prompt tokens at 4 per step: the engine schedules it (its queue time ends), then prefills for ~475 steps.
    const promptIds = Array.from({ length: 1900 }, (_, i) => 100 + (i % 500));
    const body = { model: MODEL, prompt: promptIds, max_tokens: 8, temperature: 0, stream: true };
    const redis = cluster.redis.client();
    try {
      // Frozen mid-prefill, so the client leaves before any token whatever the machine's speed: the
      // request's log must hold no text delta once the worker is stopped (a starved test can poll the
      // metrics after the prefill ended); else it runs to its end, and another one tries (5 tries).
      for (let attempt = 1; attempt <= 5; attempt++) {
        await waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
        const metrics = await scrapePrometheus(`${gateway.url}/metrics`);
        const before = metrics.value('sluice_gateway_disconnects_total', { stage: 'prefill' });
        const scheduledBefore = metrics.histogram('sluice_request_queue_time_seconds').count;
        const stream = new LiveStream(`${gateway.url}/v1/completions`, body);
        expect(await stream.headers).toBe(200);
        await waitFor('the engine scheduled it', async () =>
          (await scrapePrometheus(`${gateway.url}/metrics`)).histogram('sluice_request_queue_time_seconds').count > scheduledBefore
            ? true
            : undefined,
        );
        // No X-Request-Id sent: the job id is the gateway's request id. At most 0 of 8 tokens: none.
        const frozen = await freezeMidAnswers([worker], redis, [{ jobId: stream.requestId! }], 0);
        if (frozen === null) {
          expect(await stream.ended).toBe('done');
          continue;
        }
        try {
          expect(stream.contentChunks).toBe(0);
          stream.abort();
          expect(await stream.ended).toBe('aborted');
          await waitFor(
            'the gateway counted the disconnect',
            async () => {
              const now = (await scrapePrometheus(`${gateway.url}/metrics`)).value('sluice_gateway_disconnects_total', {
                stage: 'prefill',
              });
              return now === before + 1 ? true : undefined;
            },
            5_000,
          );
        } finally {
          worker.process.signal('SIGCONT');
        }
        await worker.sequenceCancelled(stream.requestId);
        return;
      }
      throw new Error('in each of 5 tries the prefill ended before the worker could be frozen');
    } finally {
      redis.disconnect();
    }
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
