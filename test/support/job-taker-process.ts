/** Starts `job-taker.ts` (a process that takes one job as a worker does and never accepts it) and reads what it prints. */
import { fileURLToPath } from 'node:url';
import type { Redis } from 'ioredis';
import { GENERATE_QUEUE, redisNames } from '@sluice/protocol';
import { startProcess, waitFor, type ManagedProcess } from './processes.js';

const TAKER = fileURLToPath(new URL('./job-taker.ts', import.meta.url));

export interface JobTaker {
  readonly process: ManagedProcess;
  /** Its BullMQ worker's id: the prefix of the lock of the job it takes. */
  readonly queueWorkerId: string;
  /** Resolves the id of the job it took. */
  took(): Promise<string>;
}

/** Starts a taker registered as `takerId` (its record expires `ttlMs` after its last beat) and waits until it is. */
export async function startJobTaker(redisUrl: string, takerId: string, ttlMs: string): Promise<JobTaker> {
  const taker = startProcess('job-taker', process.execPath, ['--import', 'tsx', TAKER], {
    REDIS_URL: redisUrl,
    TAKER_ID: takerId,
    WORKER_TTL_MS: ttlMs,
  });
  const queueWorkerId = await waitFor(`${takerId} registered`, async () => /registered (\S+)/.exec(taker.output())?.[1], 20_000);
  return {
    process: taker,
    queueWorkerId,
    took: () => waitFor(`${takerId} took a job`, async () => /took (\S+)/.exec(taker.output())?.[1], 20_000),
  };
}

/** The BullMQ lock of a job (the token of the worker that holds it), or null. */
export function jobLock(redis: Redis, jobId: string): Promise<string | null> {
  return redis.get(`${redisNames().bullPrefix}:${GENERATE_QUEUE}:${jobId}:lock`);
}
