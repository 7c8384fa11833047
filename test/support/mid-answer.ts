/**
 * Freezing workers while streams are still being decoded, whatever the machine's speed. The tiny
 * model decodes even 1,800 tokens in about a second, so a test process starved of CPU for that long
 * can look at a "long" stream after it ended. Redis decides: once the workers are stopped (SIGSTOP
 * stops the engine thread too), a request's token log can only grow by writes already on their way;
 * a log with no end entry and no choice past half its tokens means an answer that cannot end while
 * they stay frozen, and that still has work left when they run again.
 */
import type { Redis } from 'ioredis';
import { endsRequest } from '@sluice/protocol';
import { sleep } from './processes.js';
import type { WorkerProcess } from './sluice.js';
import { MODEL } from './cluster.js';
import { LiveStream } from './sse.js';
import { readTokenLog } from './token-log.js';

/** Time for writes the workers made before SIGSTOP to land. */
const SETTLE_MS = 150;
const ATTEMPTS = 5;

export interface Frozen {
  /** When the workers were stopped (ms since the epoch). */
  frozenAt: number;
}

/**
 * Whether the request's answer is unfinished in its token log with room left: no end entry, and no
 * choice past `maxTokens / 2` tokens (the engine may have run a few steps past what reached the log).
 */
export async function unfinishedInLog(redis: Redis, jobId: string, maxTokens: number): Promise<boolean> {
  const log = await readTokenLog(redis, jobId);
  // A choice's `text-end` counts too: with one choice, nothing is left to decode after it.
  if (log.some((entry) => endsRequest(entry) || entry.type === 'text-end')) return false;
  const tokens = new Map<number, number>();
  for (const entry of log) if (entry.type === 'text-delta') tokens.set(entry.index, (tokens.get(entry.index) ?? 0) + entry.tokens);
  return Math.max(0, ...tokens.values()) <= maxTokens / 2;
}

/**
 * SIGSTOPs `workers` and waits for the writes they made before (in the kernel's buffers, not the
 * processes) to land in Redis; says when they were stopped (ms since the epoch).
 */
export async function freeze(workers: readonly WorkerProcess[]): Promise<number> {
  for (const worker of workers) worker.process.signal('SIGSTOP');
  const frozenAt = Date.now();
  await sleep(SETTLE_MS);
  return frozenAt;
}

export function thaw(workers: readonly WorkerProcess[]): void {
  for (const worker of workers) worker.process.signal('SIGCONT');
}

/**
 * Freezes `workers` and, when every one of `streams` (of at most `maxTokens` tokens; anything with the
 * job id) is unfinished in its token log, says when; otherwise thaws the workers and says null.
 */
export async function freezeMidAnswers(
  workers: readonly WorkerProcess[],
  redis: Redis,
  streams: ReadonlyArray<Pick<LiveStream, 'jobId'>>,
  maxTokens: number,
): Promise<Frozen | null> {
  const frozenAt = await freeze(workers);
  const unfinished = await Promise.all(streams.map((stream) => unfinishedInLog(redis, stream.jobId, maxTokens)));
  if (unfinished.every(Boolean)) return { frozenAt };
  thaw(workers);
  return null;
}

/**
 * Runs `attempt` (given its number, from 1) until it returns a value, at most 5 times: a try whose
 * streams ended before the workers could be frozen mid-answer lets them go and returns undefined.
 */
export async function retryMidAnswer<T>(what: string, attempt: (n: number) => Promise<T | undefined>): Promise<T> {
  for (let n = 1; n <= ATTEMPTS; n++) {
    const done = await attempt(n);
    if (done !== undefined) return done;
  }
  throw new Error(`in each of ${ATTEMPTS} tries ${what} ended before the workers could be frozen mid-answer`);
}

/**
 * Starts streams with `start` (given the attempt, from 1) until, after `progress`, the workers are
 * frozen with every one of them mid-answer (at most 5 tries; streams of a failed try are aborted), and
 * returns them with the workers stopped: the caller sends SIGCONT.
 */
export async function startFrozenMidAnswers(
  workers: readonly WorkerProcess[],
  redis: Redis,
  options: {
    start: (attempt: number) => LiveStream[];
    progress: (stream: LiveStream) => Promise<void>;
    maxTokens: number;
  },
): Promise<Frozen & { streams: LiveStream[] }> {
  return retryMidAnswer('a stream', async (attempt) => {
    const streams = options.start(attempt);
    await Promise.all(streams.map(options.progress));
    const frozen = await freezeMidAnswers(workers, redis, streams, options.maxTokens);
    if (frozen !== null) return { ...frozen, streams };
    for (const stream of streams) stream.abort();
    await Promise.all(streams.map((stream) => stream.ended));
    return undefined;
  });
}

/**
 * A long greedy chat stream (`maxTokens` tokens) on `gatewayUrl`, read to its third chunk, with
 * `workers` frozen while it is mid-answer (see {@link startFrozenMidAnswers}): the caller sends SIGCONT.
 */
export async function frozenLongChat(
  workers: readonly WorkerProcess[],
  redis: Redis,
  gatewayUrl: string,
  maxTokens: number,
): Promise<LiveStream> {
  const body = {
    model: MODEL,
    stream: true,
    max_tokens: maxTokens,
    temperature: 0,
    messages: [{ role: 'user', content: 'Tell a long story.' }],
  };
  const { streams } = await startFrozenMidAnswers(workers, redis, {
    start: () => [new LiveStream(`${gatewayUrl}/v1/chat/completions`, body)],
    progress: (s) => s.until('streaming', () => s.contentChunks >= 3),
    maxTokens,
  });
  return streams[0]!;
}
