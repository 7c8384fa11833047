import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep, waitFor } from './support/processes.js';
import type { WorkerProcess } from './support/sluice.js';
import { startFrozenMidAnswers } from './support/mid-answer.js';
import { checkChunkSequence, LiveStream, postRaw, streamError } from './support/sse.js';
import { loggedAnswer } from './support/token-log.js';

const long = (prompt: string) => ({ model: MODEL, prompt, max_tokens: 1800, ignore_eos: true, temperature: 0, stream: true });

function dataEvents(stream: LiveStream): string[] {
  return stream.items.flatMap((item) => (item.kind === 'data' ? [item.data] : []));
}

describe('timeouts end the stream with a clear error and cancel the work', () => {
  let cluster: Cluster;
  let worker: WorkerProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // One batch slot, so a second request waits in the queue; a long TTL, so a paused worker is not "lost".
    worker = await cluster.worker({ MAX_BATCH_SIZE: '1', WORKER_TTL_MS: '60000' });
  });

  afterAll(async () => {
    worker?.process.signal('SIGCONT');
    await cluster?.stop();
  });

  const idle = () => waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
  /**
   * Freezes the worker (SIGSTOP) while `body` runs: a busy worker without the race against the tiny
   * model, which finishes even 1,800 tokens in about a second. It stays alive in the registry (long TTL).
   */
  const whilePaused = async (body: () => Promise<void>): Promise<void> => {
    worker.process.signal('SIGSTOP');
    try {
      await body();
    } finally {
      worker.process.signal('SIGCONT');
    }
  };
  /** A long stream with `chunks` content chunks, its worker frozen before it can end (see mid-answer.ts). */
  const frozenMidAnswer = async (start: () => LiveStream, chunks: number) => {
    const redis = cluster.redis.client();
    try {
      const { streams, frozenAt } = await startFrozenMidAnswers([worker], redis, {
        start: () => [start()],
        progress: (stream) => stream.until(`${chunks} content chunks`, () => stream.contentChunks >= chunks),
        maxTokens: long('').max_tokens,
      });
      return { stream: streams[0]!, frozenAt };
    } finally {
      redis.disconnect();
    }
  };

  it('heartbeats while queued, then the queue timeout ends the stream and removes the job', async () => {
    const gateway = await cluster.gateway({ HEADERS_WAIT_MS: '100', HEARTBEAT_MS: '100', QUEUE_TIMEOUT_MS: '1500' });
    const start = await worker.health();
    let fillers = 0;
    // The one batch slot busy with a filler that cannot end meanwhile: the next request waits in the queue.
    const { stream: filler } = await frozenMidAnswer(() => {
      fillers++;
      return new LiveStream(`${gateway.url}/v1/completions`, long('Filler'));
    }, 1);

    let queued: LiveStream | undefined;
    try {
      queued = new LiveStream(`${gateway.url}/v1/chat/completions`, {
        model: MODEL,
        messages: [{ role: 'user', content: 'Waiting' }],
        max_tokens: 8,
        stream: true,
      });
      // The 200 goes out after HEADERS_WAIT_MS, then pings keep the connection alive.
      expect(await queued.headers).toBe(200);
      await queued.until('three heartbeats', () => queued!.pings >= 3, 5_000);
      expect(dataEvents(queued)).toEqual([]);
      expect(await queued.ended).toBe('done');
    } finally {
      worker.process.signal('SIGCONT');
    }
    // Ended by the queue timeout: not before it, and not by anything much later (a loaded machine's timers run late).
    const elapsed = Date.now() - queued.startedAt;
    expect(elapsed).toBeGreaterThanOrEqual(1400);
    expect(elapsed).toBeLessThan(10_000);
    expect(streamError(queued.items)).toMatchObject({ code: 'queue_timeout' });
    expect(dataEvents(queued)).toHaveLength(2);

    // The gateway removes the timed-out job right after it writes the stream's end, without holding
    // the end back for Redis: the removal lands moments after the client read the error.
    const redis = cluster.redis.client();
    try {
      await waitFor(
        'the timed-out job removed from the queue',
        async () => ((await redis.llen('sluice:bull:generate:wait')) === 0 ? true : undefined),
        5_000,
      );
      expect(await redis.llen('sluice:bull:generate:wait')).toBe(0);
    } finally {
      redis.disconnect();
    }
    filler.abort();
    await idle();
    await sleep(200);
    // The worker ran the fillers and never the request that timed out in the queue.
    const end = await worker.health();
    expect(end.processed - start.processed).toBe(fillers);
    expect(end.skipped).toBe(start.skipped);
  });

  it('answers a queue timeout of a non-streaming request with 503', async () => {
    const gateway = await cluster.gateway({ QUEUE_TIMEOUT_MS: '800' });
    const filler = new LiveStream(`${gateway.url}/v1/completions`, long('Filler'));
    await filler.until('filler running', () => filler.contentChunks >= 1);
    let res: Awaited<ReturnType<typeof postRaw>> | undefined;
    await whilePaused(async () => {
      res = await postRaw(`${gateway.url}/v1/completions`, { model: MODEL, prompt: 'x', max_tokens: 4 });
    });
    if (res === undefined) throw new Error('unreachable');
    expect(res.status).toBe(503);
    expect(res.headers.get('retry-after')).not.toBeNull();
    expect(res.json).toMatchObject({ error: { code: 'queue_timeout' } });
    filler.abort();
    await idle();
  });

  it('ends a stream at its total deadline and stops its sequence', async () => {
    const gateway = await cluster.gateway({ REQUEST_TIMEOUT_MS: '1500' });
    // Frozen mid-answer, the worker stays silent but well within IDLE_TIMEOUT_MS: the deadline ends it.
    const { stream } = await frozenMidAnswer(() => new LiveStream(`${gateway.url}/v1/completions`, long('A very long story')), 3);
    try {
      expect(await stream.ended).toBe('done');
    } finally {
      worker.process.signal('SIGCONT');
    }
    const elapsed = Date.now() - stream.startedAt;
    expect(elapsed).toBeGreaterThanOrEqual(1400);
    expect(elapsed).toBeLessThan(10_000);
    expect(streamError(stream.items)).toMatchObject({ code: 'deadline_exceeded' });
    await worker.sequenceCancelled(stream.requestId);
  });

  it('ends a stream whose worker sends nothing for IDLE_TIMEOUT_MS and cancels the sequence', async () => {
    const gateway = await cluster.gateway({ IDLE_TIMEOUT_MS: '700' });
    // A frozen worker: alive in the registry (long TTL) but silent.
    const { stream, frozenAt } = await frozenMidAnswer(
      () => new LiveStream(`${gateway.url}/v1/completions`, long('A story that stalls')),
      3,
    );
    try {
      expect(await stream.ended).toBe('done');
      const elapsed = Date.now() - frozenAt;
      expect(elapsed).toBeGreaterThanOrEqual(500);
      expect(elapsed).toBeLessThan(10_000);
      expect(streamError(stream.items)).toMatchObject({ code: 'idle_timeout' });
    } finally {
      worker.process.signal('SIGCONT');
    }
    // The cancel was waiting in the worker's socket: the sequence leaves once it runs again.
    await worker.sequenceCancelled(stream.requestId);
  });

  it('delivers the whole answer, not an idle_timeout, when the gateway itself was stopped past IDLE_TIMEOUT_MS', async () => {
    const idleTimeoutMs = 2_000;
    const gateway = await cluster.gateway({ IDLE_TIMEOUT_MS: String(idleTimeoutMs) });
    const redis = cluster.redis.client();
    const stream = new LiveStream(`${gateway.url}/v1/completions`, long('A gateway that is paused'));
    try {
      await stream.until('3 content chunks', () => stream.contentChunks >= 3);
      // Stopped (as a paused VM or container): the worker goes on, its entries wait in the gateway's
      // socket and in the token log. It used to wake, run its sweep before reading the socket, and end
      // the stream with "The worker sent nothing for too long".
      gateway.process.signal('SIGSTOP');
      const stoppedAt = Date.now();
      await waitFor(
        'the answer in the token log',
        async () => ((await loggedAnswer(redis, stream.jobId)).ended ? true : undefined),
        30_000,
      );
      await sleep(Math.max(0, stoppedAt + idleTimeoutMs + 1_500 - Date.now()));
    } finally {
      gateway.process.signal('SIGCONT');
    }
    try {
      expect(await stream.ended).toBe('done');
      const answer = checkChunkSequence(stream.items, 'completion', false);
      expect(answer.finishReason).toBe('length');
      expect(answer.text).toBe((await loggedAnswer(redis, stream.jobId)).text);
    } finally {
      redis.disconnect();
    }
  });
});
