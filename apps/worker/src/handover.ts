import type { Queue } from 'bullmq';
import type { Redis } from 'ioredis';
import { continuationJob, continuationJobOptions, GENERATE_JOB, RequestScripts, type GenerateJob, type RedisNames } from '@sluice/protocol';

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
  readonly #scripts: RequestScripts;

  constructor(
    redis: Redis,
    private readonly queue: Queue,
    names: RedisNames,
    private readonly workerId: string,
  ) {
    this.#scripts = new RequestScripts(redis, names);
  }

  /**
   * Moves the request to a new attempt and enqueues its continuation. Call it only after everything
   * this worker wrote for the request is in its log. Resolves `moved: false` when the request cannot
   * move (its meta is gone, or it is not this worker's any more), with the request's attempt now: a
   * higher one means someone else moved it already.
   * @param channel where this worker's view routes its live entries ('' while detached: then the meta
   *   says so too, from now if only this worker knew; any other leaves the meta's route as it is)
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
    const [code, current] = await this.#scripts.migrate(job.requestId, attempt, from, bound, channel, 'worker');
    if (code !== 1) return { moved: false, attempt: current };
    await this.queue.add(GENERATE_JOB, continuationJob(job, current, channel), continuationJobOptions(job.requestId, current));
    return { moved: true, attempt: current };
  }
}
