import type { Queue } from 'bullmq';
import type { Redis } from 'ioredis';
import { attemptJobId, GENERATE_JOB, MIGRATE_SCRIPT, type GenerateJob, type RedisNames } from '@sluice/protocol';

/**
 * A planned move is not a fault: a drain does not count against the gateways' MAX_MIGRATIONS (that
 * bound stops a request that kills its workers from killing more).
 */
const NO_BOUND = 1_000_000;

/**
 * A draining worker's way to hand its unfinished requests to other workers instead of ending their
 * streams: the same move a gateway makes for a lost worker (MIGRATE_SCRIPT bumps the request's attempt,
 * so this worker's later writes are fenced out; a continuation job carries the request on, on the queue,
 * from its token log), made by the worker itself while it still holds the job's data. Detached requests
 * (no gateway streams them now) move too, and stay detached.
 */
export class RequestHandover {
  readonly #redis: Redis & { migrateRequest?: (...args: Array<string | number>) => Promise<[number, number]> };

  constructor(
    redis: Redis,
    private readonly queue: Queue,
    private readonly names: RedisNames,
    private readonly workerId: string,
  ) {
    this.#redis = redis;
    redis.defineCommand('migrateRequest', { numberOfKeys: 1, lua: MIGRATE_SCRIPT });
  }

  /**
   * Moves the request to a new attempt and enqueues its continuation. Call it only after everything
   * this worker wrote for the request is in its log. Resolves `moved: false` when the request cannot
   * move (its meta is gone, or it is not this worker's any more), with the request's attempt now: a
   * higher one means someone else moved it already.
   * @param channel where its live entries go now ('' while detached)
   * @param from the worker whose attempt ends (this one when draining; a dead one when recovering)
   * @param bound the most attempts the request may have had (the gateways' MAX_MIGRATIONS for a fault)
   */
  async handOver(
    job: GenerateJob,
    attempt: number,
    channel: string,
    from = this.workerId,
    bound = NO_BOUND,
  ): Promise<{ moved: boolean; attempt: number }> {
    const [code, current] = await this.#redis.migrateRequest!(this.names.metaKey(job.requestId), attempt, from, bound, channel, Date.now());
    if (code !== 1) return { moved: false, attempt: current };
    // A detached request keeps its job's channel: the next worker reads the meta (no channel) and runs it detached.
    const next: GenerateJob = { ...job, channel: channel === '' ? job.channel : channel, continuation: { attempt: current } };
    await this.queue.add(GENERATE_JOB, next, {
      jobId: attemptJobId(job.requestId, current),
      // A stream already under way goes before new requests.
      lifo: true,
      removeOnComplete: true,
      removeOnFail: true,
      attempts: 1,
    });
    return { moved: true, attempt: current };
  }
}
