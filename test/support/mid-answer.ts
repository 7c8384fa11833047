/**
 * Freezing a worker while a stream is still being decoded, whatever the machine's speed. The tiny
 * model decodes even 1,800 tokens in about a second, so a test process starved of CPU for that long
 * (the suite runs files in parallel on 2 cores) can look at a "long" stream after it ended. Redis
 * decides: once the worker is stopped, its request's token log can only grow by writes already on
 * their way, so a log without an end entry means an answer that cannot end while the worker stays
 * frozen.
 */
import type { Redis } from 'ioredis';
import { decodeLogRange, redisNames } from '@sluice/protocol';
import { sleep } from './processes.js';
import type { WorkerProcess } from './sluice.js';
import type { LiveStream } from './sse.js';

/** Entry types after which a request's log holds nothing more to decode. */
const ENDS = new Set(['text-end', 'finish', 'error', 'rejected']);
/** Time for writes the worker made before SIGSTOP (in the kernel's buffers, not the process) to land. */
const SETTLE_MS = 150;
const ATTEMPTS = 5;

/**
 * SIGSTOPs `worker` and, when `stream`'s answer was still unfinished in its token log, says when it
 * stopped the worker (ms since the epoch); when the answer had ended, thaws the worker and says null.
 */
export async function freezeMidAnswer(worker: WorkerProcess, redis: Redis, stream: LiveStream): Promise<number | null> {
  if (stream.requestId === null) throw new Error('freezeMidAnswer: the stream has no x-request-id yet');
  worker.process.signal('SIGSTOP');
  const frozenAt = Date.now();
  await sleep(SETTLE_MS);
  const log = decodeLogRange(await redis.xrange(redisNames().logKey(stream.requestId), '-', '+'));
  if (!log.some((entry) => ENDS.has(entry.type))) return frozenAt;
  worker.process.signal('SIGCONT');
  return null;
}

/**
 * Starts streams with `start` until one is frozen mid-answer after `progress` (at most 5; one that
 * ended first is dropped) and returns it, with when `worker` was stopped: the caller sends SIGCONT.
 */
export async function startFrozenMidAnswer(
  worker: WorkerProcess,
  redis: Redis,
  start: () => LiveStream,
  progress: (stream: LiveStream) => Promise<void>,
): Promise<{ stream: LiveStream; frozenAt: number }> {
  for (let attempt = 1; attempt <= ATTEMPTS; attempt++) {
    const stream = start();
    await progress(stream);
    const frozenAt = await freezeMidAnswer(worker, redis, stream);
    if (frozenAt !== null) return { stream, frozenAt };
    stream.abort();
    await stream.ended;
  }
  throw new Error(`every one of ${ATTEMPTS} streams ended before the worker could be frozen mid-answer`);
}
