/**
 * What a worker generated for a request, read from the request's token log in Redis: the ground truth
 * a client's stream must deliver exactly, whatever was killed or resumed on the way.
 */
import type { Redis } from 'ioredis';
import { decodeLogRange, endsRequest, redisNames, type GatewayEntry } from '@sluice/protocol';

export interface LoggedAnswer {
  /** Choice 0's text, its deltas in log order. */
  text: string;
  /** Choice 0's completion tokens. */
  tokens: number;
  /** The log holds the request's end (finish, error or rejected). */
  ended: boolean;
}

/** Every entry of the request's token log, in order. */
export async function readTokenLog(redis: Redis, jobId: string): Promise<GatewayEntry[]> {
  return decodeLogRange(await redis.xrange(redisNames().logKey(jobId), '-', '+'));
}

/** Reads it while the log is kept (STREAM_RETENTION_MS after the request ended). */
export async function loggedAnswer(redis: Redis, jobId: string): Promise<LoggedAnswer> {
  const log = await readTokenLog(redis, jobId);
  const answer: LoggedAnswer = { text: '', tokens: 0, ended: false };
  for (const entry of log) {
    if (entry.type === 'text-delta' && entry.index === 0) {
      answer.text += entry.text;
      answer.tokens += entry.tokens;
    }
    if (endsRequest(entry)) answer.ended = true;
  }
  return answer;
}
