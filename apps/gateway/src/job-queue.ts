import type { Queue } from 'bullmq';
import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { encodeCancelMessage, GENERATE_JOB, type CancelReason, type GenerateJob, type RedisNames } from '@sluice/protocol';
import type { RequestSession } from './request-session.js';
import type { WorkCanceller } from './session-manager.js';

/** Hands a job to the workers. */
export interface JobSubmitter {
  submit(job: GenerateJob): Promise<void>;
}

/** A cancel marker outlives the request's deadline by this much: a worker never starts a job after it. */
const MARKER_MARGIN_MS = 5_000;

/**
 * The gateway's side of the BullMQ queue: enqueues jobs and cancels them. A cancel removes the job
 * while it still waits, and always sets a cancel marker (for a worker that takes the job later) and
 * publishes on the cancel channel (for the worker running it). Cancels of one tick go out in one
 * round trip.
 */
export class RedisJobQueue implements JobSubmitter, WorkCanceller {
  private pending: Array<{ requestId: string; reason: CancelReason; ttlMs: number; wasQueued: boolean }> = [];

  constructor(
    private readonly queue: Queue,
    private readonly redis: Redis,
    private readonly names: RedisNames,
    private readonly logger: Logger,
  ) {}

  async submit(job: GenerateJob): Promise<void> {
    await this.queue.add(GENERATE_JOB, job, {
      jobId: job.requestId,
      // Job data holds the prompt in clear: nothing stays in Redis once the job settles.
      removeOnComplete: true,
      removeOnFail: true,
      attempts: 1,
    });
  }

  cancel(session: RequestSession, reason: CancelReason, wasQueued: boolean): void {
    if (this.pending.length === 0) queueMicrotask(() => this.flush());
    const ttlMs = Math.max(1_000, session.deadlineAt - Date.now()) + MARKER_MARGIN_MS;
    this.pending.push({ requestId: session.requestId, reason, ttlMs, wasQueued });
  }

  private flush(): void {
    const batch = this.pending;
    this.pending = [];
    const multi = this.redis.multi();
    const byReason = new Map<CancelReason, string[]>();
    for (const { requestId, reason, ttlMs } of batch) {
      multi.set(this.names.cancelMarkerKey(requestId), reason, 'PX', ttlMs);
      const ids = byReason.get(reason) ?? [];
      ids.push(requestId);
      byReason.set(reason, ids);
    }
    for (const [reason, requestIds] of byReason) {
      multi.publish(this.names.cancelChannel, encodeCancelMessage({ requestIds, reason }));
    }
    multi.exec().catch((error: unknown) => this.logger.error({ err: error }, 'publishing cancels failed'));
    for (const { requestId, wasQueued } of batch) {
      if (!wasQueued) continue;
      // Removes a waiting job; a job a worker holds is locked and stays (the cancel reaches that worker).
      this.queue.remove(requestId).catch((error: unknown) => this.logger.warn({ err: error, requestId }, 'removing job failed'));
    }
  }
}
