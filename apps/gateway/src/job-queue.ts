import { setTimeout as sleep } from 'node:timers/promises';
import type { Queue } from 'bullmq';
import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import {
  attemptJobId,
  parseAttemptJobId,
  encodeControlMessage,
  encodeGatewayBroadcast,
  encodeGatewayMessage,
  type GatewayEntry,
  type RequestMeta,
  encodeRequestMeta,
  decodeRequestMeta,
  GENERATE_JOB,
  RequestScripts,
  continuationJob,
  continuationJobOptions,
  openChoices,
  readLog,
  sentTokens,
  type CancelReason,
  type GenerateJob,
  type RedisNames,
  type StreamFormat,
  type WorkerRecord,
} from '@sluice/protocol';
import type { RequestSession } from './request-session.js';
import type { WorkCanceller } from './session-manager.js';
import { readWorkerRecords } from './worker-registry.js';

/** Hands a job to the workers, and steers it later from any gateway. */
export interface JobSubmitter {
  /**
   * Writes the request's meta (route, grace, how its chunks look, the key that owns it), then
   * enqueues the job. @param owner the requesting API key's hash ('' without keys)
   */
  submit(job: GenerateJob, format: StreamFormat, owner?: string): Promise<void>;
  /** Routes a request's live entries to this gateway (a resume). */
  attach(requestId: string): Promise<void>;
  /** Where the request's first job stands (one read of both facts; see {@link JobState}). */
  jobState(requestId: string): Promise<JobState>;
  /** Stops a request wherever it runs or waits (`POST .../{id}/cancel`). */
  cancelRequest(requestId: string, meta: RequestMeta): Promise<void>;
}

/** A request's first job as Redis has it now. */
export interface JobState {
  /** In the queue: waiting, or taken by a worker and not yet settled. */
  queued: boolean;
  /** A cancel marker waits for it: a cancel of it is under way or done. */
  cancelled: boolean;
}

/**
 * A cancel marker is for a worker that took the job just as it was cancelled (the queue could not
 * remove it: locked): that worker reads the marker as it starts the job, within moments. A running job
 * is stopped by the control message; its marker only tells a retry under the same Idempotency-Key
 * that the answer will end `abort` (it reaches the log a step later). A job the queue removed needs
 * none. So no marker waits out the request's deadline (1,500 disconnects once left ~950 keys for 10
 * minutes).
 */
const MARKER_TTL_MS = 30_000;

/** A marker's TTL: the pickup window, never past the request's deadline (+1 s). */
function markerTtlMs(deadlineAt: number): number {
  return Math.min(MARKER_TTL_MS, Math.max(0, deadlineAt - Date.now()) + 1_000);
}

/** What {@link WorkCanceller.migrate} did: moved to `attempt`, or why not. */
export type MigrationResult =
  | { outcome: 'migrated'; attempt: number }
  /** Someone else moved it already (or its worker is not the lost one): `attempt` is the current one. */
  | { outcome: 'moved'; attempt: number }
  /** It used up MAX_MIGRATIONS. */
  | { outcome: 'exhausted' }
  /** Nothing is left to continue it from (its meta or its job is gone). */
  | { outcome: 'gone' };

/**
 * The gateway's side of the BullMQ queue: enqueues jobs and cancels them. A cancel removes the job
 * while it still waits, and always sets a cancel marker (for a worker that takes the job later) and
 * publishes on the control channel (for the worker running it). Cancels of one tick go out in one
 * round trip.
 */
export class RedisJobQueue implements JobSubmitter, WorkCanceller {
  private readonly scripts: RequestScripts;
  private pending: Array<{ requestId: string; reason: CancelReason; ttlMs: number; wasQueued: boolean }> = [];

  constructor(
    private readonly queue: Queue,
    private readonly redis: Redis,
    private readonly names: RedisNames,
    /** This gateway's channel: its cancels and detaches apply only while a request still routes here. */
    private readonly channel: string,
    /** How long a request's meta and log outlive its deadline at most. */
    private readonly retentionMs: number,
    /** How many times a request may move to another worker after its worker was lost. */
    private readonly maxMigrations: number,
    private readonly logger: Logger,
  ) {
    this.scripts = new RequestScripts(redis, names);
  }

  async submit(job: GenerateJob, format: StreamFormat, owner = ''): Promise<void> {
    const ttlMs = Math.max(1, job.deadlineAt - Date.now()) + this.retentionMs;
    // The meta goes out just before the add, on the same connection (the gateway gives this class the
    // queue's): one connection keeps the order, so the meta exists before any worker can take the job,
    // and both take one round trip instead of two (TTFT).
    const written = this.scripts.createMeta(
      job.requestId,
      encodeRequestMeta({
        channel: job.channel,
        graceMs: job.resumeGraceMs,
        attempt: 1,
        enqueuedAt: job.enqueuedAt,
        deadlineAt: job.deadlineAt,
        format,
        owner,
      }),
      ttlMs,
    );
    const added = this.queue.add(GENERATE_JOB, job, {
      jobId: job.requestId,
      // Job data holds the prompt in clear: nothing stays in Redis once the job settles.
      removeOnComplete: true,
      removeOnFail: true,
      attempts: 1,
    });
    await Promise.all([written, added]);
  }

  cancel(session: RequestSession, reason: CancelReason, wasQueued: boolean): void {
    if (this.pending.length === 0) queueMicrotask(() => this.flush());
    this.pending.push({ requestId: session.requestId, reason, ttlMs: markerTtlMs(session.deadlineAt), wasQueued });
  }

  private flush(): void {
    const batch = this.pending;
    this.pending = [];
    const multi = this.redis.multi();
    const byReason = new Map<CancelReason, string[]>();
    for (const { requestId, reason, ttlMs } of batch) {
      // A worker that accepted the job gets the control message (fenced there by this channel). The
      // marker, set only while the request still routes here (a client that resumed it on another
      // gateway, then closed this connection, wants the work done), tells a worker that takes a waiting
      // job later, and a retry under the same Idempotency-Key that the request's answer will not come
      // (its `abort` reaches the log a step later, or once the job is removed).
      this.scripts.cancelIfRouted(multi, requestId, this.channel, reason, ttlMs);
      const ids = byReason.get(reason) ?? [];
      ids.push(requestId);
      byReason.set(reason, ids);
    }
    for (const [reason, requestIds] of byReason) {
      multi.publish(this.names.controlChannel, encodeControlMessage({ type: 'cancel', requestIds, reason, channel: this.channel }));
    }
    multi
      .exec()
      .then((replies) => {
        for (const [i, { requestId, wasQueued }] of batch.entries()) {
          const [error, marked] = replies?.[i] ?? [null, 0];
          // Not marked: resumed on another gateway (the job stays for it). A running one is stopped by
          // the control message.
          if (!wasQueued || error !== null || marked !== 1) continue;
          // Removes a waiting job; a job a worker holds is locked and stays (the marker reaches that worker).
          this.removeWaiting(requestId).catch((error: unknown) => this.logger.warn({ err: error, requestId }, 'removing job failed'));
        }
      })
      .catch((error: unknown) => this.logger.error({ err: error }, 'publishing cancels failed'));
  }

  /**
   * Removes the waiting job of a request whose cancel marker this gateway set (see {@link flush}), and
   * ends its log as {@link cancelRequest} does: a delivery resumed after the cancel (on any gateway)
   * reads the ending instead of waiting for a job that is gone.
   */
  private async removeWaiting(requestId: string): Promise<void> {
    const meta = decodeRequestMeta(await this.redis.hgetall(this.names.metaKey(requestId)));
    if (meta === undefined) {
      // No stream to end (nothing can resume it without its meta): only the job goes.
      await this.removeQueued(requestId);
      return;
    }
    if (!(await this.removeQueued(requestId, attemptJobId(requestId, meta.attempt)))) return;
    await this.endRemoved(requestId, meta);
  }

  /**
   * Removes a waiting job; once it is gone, its marker has nobody left to tell. Resolves true when removed.
   * @param jobId the job's BullMQ id (a continuation's differs from its request's)
   */
  private async removeQueued(requestId: string, jobId = requestId): Promise<boolean> {
    const removed = (await this.queue.remove(jobId)) === 1;
    if (removed) await this.redis.del(this.names.cancelMarkerKey(requestId));
    return removed;
  }

  /** The client left with a grace: the request stops publishing here and waits for a resume (or its grace). */
  detach(session: RequestSession): void {
    const requestId = session.requestId;
    const now = Date.now();
    // The meta tells a worker that takes the job later; the message tells the worker running it.
    this.scripts
      .route(requestId, '', this.channel, now)
      .then(() =>
        this.redis.publish(
          this.names.controlChannel,
          encodeControlMessage({ type: 'route', requestId, channel: null, from: this.channel }),
        ),
      )
      .catch((error: unknown) => this.logger.warn({ err: error, requestId }, 'detaching a request failed'));
  }

  /**
   * The request's worker was lost: fence its attempt out of the log and enqueue a continuation (at
   * the front of the queue) that goes on from the token ids in the log. Exactly one caller wins.
   * The lost attempt's job is read first: the continuation carries its data (the prompt), and a worker
   * that only looked dead (Redis stalled, say) may settle and remove it while the move is made — its
   * last appends fenced out, its job gone, the request left with no job to go on from. A job already
   * gone moves nothing: the request ended (its log says how), or a newer attempt has it (`moved`).
   * @param channel where its live entries go next: this gateway's, or '' to keep the route as it is
   * @param announce tell every gateway of the new attempt as it is made (`attempt-moved`): a move no
   *   session of the request asked for
   */
  async migrate(
    requestId: string,
    attempt: number,
    lostWorkerId: string,
    channel = this.channel,
    announce = false,
  ): Promise<MigrationResult> {
    const previous = await this.queue.getJob(attemptJobId(requestId, attempt));
    if (previous === undefined) {
      const current = Number(await this.redis.hget(this.names.metaKey(requestId), 'attempt'));
      return current > attempt ? { outcome: 'moved', attempt: current } : { outcome: 'gone' };
    }
    const announcement = announce
      ? {
          channel: this.names.gatewaysChannel,
          message: encodeGatewayBroadcast({ type: 'attempt-moved', requestId, attempt: attempt + 1 }),
        }
      : undefined;
    const [code, current] = await this.scripts.migrate(
      requestId,
      attempt,
      lostWorkerId,
      this.maxMigrations,
      channel,
      'gateway',
      Date.now(),
      announcement,
    );
    if (code === 0) return { outcome: 'moved', attempt: current };
    if (code !== 1) return { outcome: code === 2 ? 'exhausted' : 'gone' };
    await this.queue.add(
      GENERATE_JOB,
      continuationJob(previous.data as GenerateJob, current, channel),
      continuationJobOptions(requestId, current),
    );
    return { outcome: 'migrated', attempt: current };
  }

  /**
   * Moves the requests of lost workers that no session of this gateway moves (see
   * `SessionManager.failLostWorkers`), found among BullMQ's active jobs:
   * - detached ones (their client left within its resume grace, so no gateway holds a session to
   *   migrate them), whose meta names a lost worker: they stay detached, and keep generating into their
   *   log for a client that resumes;
   * - ones a lost worker took and had not accepted (the meta names no worker for the job's attempt, and
   *   the job's lock is the lost worker's): no gateway knows their worker, and BullMQ would hand them on
   *   only once the lock lapsed and a stalled-job check ran (30–60 s). They keep their route: a session
   *   waiting for them (here or on another gateway) gets the new attempt's entries as a worker writes them.
   * Every gateway that sees the loss tries; the fenced move lets one win. A worker that merely looked
   * dead finds its attempt fenced out of the log, and what it still publishes live is dropped by a
   * session of the request, told of the new attempt by the move (`attempt-moved`); a BullMQ retry of the
   * old job is superseded.
   * @returns how many this gateway moved
   */
  async recoverLost(lost: readonly WorkerRecord[], hasSession: (requestId: string) => boolean): Promise<number> {
    const lostIds = new Set(lost.map((record) => record.workerId));
    const lockPrefixes = lost.flatMap((record) =>
      record.queueWorkerId === undefined ? [] : [[`${record.queueWorkerId}:`, record.workerId] as const],
    );
    return this.moveActive(
      (workerId, requestId) => lostIds.has(workerId) && !hasSession(requestId),
      (lock) => lockPrefixes.find(([prefix]) => lock.startsWith(prefix))?.[1],
    );
  }

  /**
   * At this gateway's start, {@link recoverLost} for the workers that were gone before its first registry
   * read (it never saw their records, and may be the only gateway left that could move their requests):
   * an active job's worker is gone when the registry, read after the job's lock and meta, names neither
   * the worker of its meta (an accepted, detached request) nor the worker whose BullMQ id begins its
   * lock (a request taken and not accepted). A worker registers before it takes a job, so a lock read
   * first is accounted for by a record read after it unless its worker's record expired. While a live
   * worker's record carries no BullMQ id (a worker from before it did), locks are not judged.
   * @param confirmAfterMs the registry is read twice this far apart, and a worker either read finds is
   *   live (as `WorkerRegistry` takes a worker for gone only when two reads in a row lack it): a gateway
   *   that starts as Redis comes back from a stall past the records' TTL must not move live workers' jobs
   * @returns how many this gateway moved
   */
  async recoverOrphans(hasSession: (requestId: string) => boolean, confirmAfterMs = 0): Promise<number> {
    let live: Map<string, WorkerRecord> | undefined;
    return this.moveActive(
      (workerId, requestId) => live !== undefined && !live.has(workerId) && !hasSession(requestId),
      (lock) => {
        const records = [...(live?.values() ?? [])];
        if (live === undefined || records.some((record) => record.queueWorkerId === undefined)) return undefined;
        return records.some((record) => lock.startsWith(`${record.queueWorkerId}:`)) ? undefined : lock;
      },
      async () => {
        const first = (await readWorkerRecords(this.redis, this.names)).workers;
        if (confirmAfterMs > 0) {
          await sleep(confirmAfterMs);
          for (const [workerId, record] of (await readWorkerRecords(this.redis, this.names)).workers) {
            if (!first.has(workerId)) first.set(workerId, record);
          }
        }
        live = first;
      },
    );
  }

  /**
   * The fenced move ({@link migrate}, announced) of BullMQ's active jobs whose worker is gone, each of
   * its current attempt: a detached one whose meta names a worker `acceptedBy` says is gone, and one no
   * worker accepted whose lock `takenBy` names a gone worker's (the lost worker's id, or any other
   * string for the move: the meta names none). `afterReads` runs once the metas and locks are read.
   */
  private async moveActive(
    acceptedBy: (workerId: string, requestId: string) => boolean,
    takenBy: (lock: string) => string | undefined,
    afterReads?: () => Promise<void>,
  ): Promise<number> {
    const jobs = await this.jobsIn(['active']);
    if (jobs.length === 0) return 0;
    const reads = this.redis.pipeline();
    for (const { jobId, requestId } of jobs) reads.hgetall(this.names.metaKey(requestId)).get(`${this.queue.toKey(jobId)}:lock`);
    const replies = (await reads.exec()) ?? [];
    await afterReads?.();
    let moved = 0;
    for (const [i, { requestId, attempt }] of jobs.entries()) {
      const meta = decodeRequestMeta((replies[2 * i]?.[1] as Record<string, string> | undefined) ?? {});
      const lock = replies[2 * i + 1]?.[1];
      if (meta === undefined || meta.attempt !== attempt) continue;
      let from: string | undefined;
      if (meta.workerId !== undefined) {
        if (meta.channel === '' && acceptedBy(meta.workerId, requestId)) from = meta.workerId;
      } else if (typeof lock === 'string') {
        from = takenBy(lock);
      }
      if (from === undefined) continue;
      // '' leaves the route as the meta has it when the move is made (attached anywhere, or detached).
      const result = await this.migrate(requestId, attempt, from, '', true);
      if (result.outcome === 'migrated') moved++;
    }
    return moved;
  }

  /**
   * The jobs in BullMQ's `states`, each with the request and attempt its id names: ids only (one read
   * of the states' lists), never the jobs' data — a scan over a deep queue must not pull every prompt
   * out of Redis, least of all on every gateway at once as a worker's loss makes them all look.
   */
  private async jobsIn(
    states: Array<'active' | 'waiting' | 'prioritized'>,
  ): Promise<Array<{ jobId: string; requestId: string; attempt: number }>> {
    const ids = await this.queue.getRanges(states, 0, -1);
    return ids.map((jobId) => ({ jobId, ...parseAttemptJobId(jobId) }));
  }

  /**
   * The API key `owner` was revoked: stops its detached requests, running or waiting (their client left
   * within a resume grace, so no gateway holds a session to end them, and nobody may resume them now:
   * they would run on unseen until their grace ran out). Found among BullMQ's jobs by their meta, as
   * {@link recoverLost} finds those of lost workers, and cancelled as `POST .../{id}/cancel` does.
   * Every gateway told of the revoke tries; a second cancel changes nothing.
   * @returns how many it stopped
   */
  async cancelDetachedOf(owner: string): Promise<number> {
    const requestIds = new Set((await this.jobsIn(['active', 'waiting', 'prioritized'])).map((job) => job.requestId));
    if (requestIds.size === 0) return 0;
    const reads = this.redis.pipeline();
    for (const requestId of requestIds) reads.hgetall(this.names.metaKey(requestId));
    const metas = (await reads.exec()) ?? [];
    let cancelled = 0;
    for (const [i, requestId] of [...requestIds].entries()) {
      const meta = decodeRequestMeta((metas[i]?.[1] as Record<string, string> | undefined) ?? {});
      if (meta === undefined || meta.owner !== owner || meta.channel !== '') continue;
      await this.cancelRequest(requestId, meta, 'key_revoked');
      cancelled++;
    }
    return cancelled;
  }

  /**
   * Routes a request's live entries to this gateway (a client resumed it here). Resolves once the
   * route is recorded, so a log read started afterwards misses nothing this gateway will not get live.
   * The worker hears of it on the control channel; a gateway still delivering it (its first connection,
   * open) on the gateways' channel, and reads the rest from the log.
   */
  async attach(requestId: string): Promise<void> {
    await this.scripts.route(requestId, this.channel, '');
    const replies = await this.redis
      .pipeline()
      .publish(this.names.controlChannel, encodeControlMessage({ type: 'route', requestId, channel: this.channel }))
      .publish(this.names.gatewaysChannel, encodeGatewayBroadcast({ type: 'route-moved', requestId, channel: this.channel }))
      .exec();
    for (const [error] of replies ?? []) if (error !== null) throw error;
  }

  async jobState(requestId: string): Promise<JobState> {
    // One read of both: a cancel removes the job before it deletes the marker, so one is always seen.
    const replies = await this.redis.multi().exists(this.queue.toKey(requestId)).exists(this.names.cancelMarkerKey(requestId)).exec();
    const [[jobError, job] = [null, 0], [markerError, marker] = [null, 0]] = replies ?? [];
    if (jobError !== null) throw jobError;
    if (markerError !== null) throw markerError;
    return { queued: job === 1, cancelled: marker === 1 };
  }

  /**
   * `POST .../{id}/cancel`, from any gateway: stops the request wherever it runs. A request still in
   * the queue is removed, and its stream (if a gateway holds one) is ended here: an `accepted`, each
   * choice ended `abort`, and a `finish`, as a worker would have written them.
   */
  async cancelRequest(requestId: string, meta: RequestMeta, reason: CancelReason = 'cancelled'): Promise<void> {
    await this.redis
      .multi()
      .set(this.names.cancelMarkerKey(requestId), reason, 'PX', markerTtlMs(meta.deadlineAt))
      .publish(this.names.controlChannel, encodeControlMessage({ type: 'cancel', requestIds: [requestId], reason }))
      .exec();
    // The current attempt's job: after a migration, the continuation waits under its own id.
    if (!(await this.removeQueued(requestId, attemptJobId(requestId, meta.attempt)))) return;
    await this.endRemoved(requestId, meta);
  }

  /**
   * Ends the log of a request whose waiting job was removed: an `accepted`, each choice ended `abort`,
   * and a `finish`, as a worker would have written them; published to its route.
   */
  private async endRemoved(requestId: string, meta: RequestMeta): Promise<void> {
    const entries: GatewayEntry[] = [];
    const attempt = meta.attempt > 1 ? { attempt: meta.attempt } : {};
    let open = Array.from({ length: meta.format.n }, (_, index) => index);
    let usage = { promptTokens: 0, completionTokens: 0 };
    let seq = 0;
    if (meta.attempt === 1) {
      entries.push({ requestId, seq: seq++, type: 'accepted', workerId: '', promptTokens: 0 });
    } else {
      // A continuation goes on after what the lost worker logged: its open choices end, its tokens count.
      const log = readLog(await this.redis.xrange(this.names.logKey(requestId), '-', '+'), meta.format.n);
      if (log.ended || log.lastSeq < 0) return;
      open = openChoices(log);
      usage = { promptTokens: log.promptTokens, completionTokens: sentTokens(log) };
      seq = log.lastSeq + 1;
    }
    for (const index of open) entries.push({ requestId, seq: seq++, type: 'text-end', index, finishReason: 'abort', ...attempt });
    entries.push({ requestId, seq, type: 'finish', usage, ...attempt });
    const pairs = entries.flatMap((entry) => [String(entry.seq), JSON.stringify(entry)]);
    await this.scripts.writeEntries(
      // The cap leaves a continuation's earlier entries in place (the log is capped where workers write it).
      [{ requestId, attempt: meta.attempt, maxEntries: seq + 100, ttlMs: this.retentionMs, workerId: '', pairs }],
      meta.channel === '' ? [] : [{ channel: meta.channel, message: encodeGatewayMessage({ workerId: '', entries }) }],
    );
  }
}
