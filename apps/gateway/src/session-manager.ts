import { endsRequest, type CancelReason, type GatewayEntry, type GatewayMessage } from '@sluice/protocol';
import type { Logger } from 'pino';
import { CancelledRequests } from './cancelled-requests.js';
import { GatewayError } from './errors.js';
import { isWaiting, RequestSession, type SessionEvent } from './request-session.js';
import type { MigrationResult } from './job-queue.js';
import type { TokenLog } from './token-log-reader.js';

/** Stops the work of a request that nobody waits for any more, or lets it outlive its client. */
export interface WorkCanceller {
  cancel(session: RequestSession, reason: CancelReason, wasQueued: boolean): void;
  /** The client left with a resume grace: the request goes on into its log until resumed or the grace ends. */
  detach(session: RequestSession): void;
  /** The request's worker was lost: continue it on another worker from its log. */
  migrate(requestId: string, attempt: number, lostWorkerId: string): Promise<MigrationResult>;
}

export interface SessionManagerOptions {
  /** Max time from enqueue to the worker's accept. */
  queueTimeoutMs: number;
  /** Max time between entries once accepted. */
  idleTimeoutMs: number;
}

/** A session that heard nothing for this long reads its token log once (and again after as long). */
const REPAIR_IDLE_MS = 1_000;

/** A repair whose log read failed reads again after this long. */
const REPAIR_RETRY_MS = 200;

/** A sweep timer this much later than two of its periods means the process was stopped or blocked. */
const STALL_SLACK_MS = 250;

/**
 * The demultiplexer's table: request id → session. Delivers every request's entries exactly once and
 * in order: pub/sub is the fast path, and a sequence gap (a lost message, a subscriber that reconnected)
 * is repaired from the request's token log in Redis; a stream fails only when the log lacks the
 * entries. Runs the queue / idle / deadline timeouts from one sweep timer and fails the streams of
 * workers that stopped heartbeating. Every way a session ends goes through here, so work is cancelled
 * exactly when the answer is no longer wanted.
 */
export class SessionManager {
  private readonly sessions = new Map<string, RequestSession>();
  private queued = 0;
  /** Queue places held by requests being admitted (see {@link reserveQueued}). */
  private reserved = 0;
  private readonly sweepTimer: NodeJS.Timeout;
  /**
   * Since when this gateway has been awake to hear its workers: the queue and idle timeouts count only
   * time after it. A process that was stopped (SIGSTOP, a paused VM, a long GC or blocked loop) wakes
   * with its workers' entries unread in its sockets, and its timers run before its sockets are read:
   * the first sweep would otherwise end healthy streams with a false `idle_timeout`.
   */
  private awakeSince = 0;
  private lastTickAt = Date.now();
  private emptyWaiters: Array<() => void> = [];
  /** Cancels sent, to send again if the request's entries keep coming (a worker missed the message). */
  private readonly cancelled = new CancelledRequests();

  constructor(
    private readonly options: SessionManagerOptions,
    private readonly canceller: WorkCanceller,
    private readonly log: TokenLog,
    private readonly logger: Logger,
    /** Told of every sequence gap (metrics). */
    private readonly onGap: (info: { requestId: string; expected: number; got: number }) => void = () => {},
    /** Told of every stream moved to another worker (metrics): `true` when this gateway moved it. */
    private readonly onMigrated: (byThisGateway: boolean) => void = () => {},
  ) {
    const sweepMs = Math.max(10, Math.min(500, Math.floor(Math.min(options.queueTimeoutMs, options.idleTimeoutMs) / 10)));
    this.sweepTimer = setInterval(() => this.tick(sweepMs), sweepMs);
    this.sweepTimer.unref();
  }

  /** Whether this gateway holds a session of the request. */
  has(requestId: string): boolean {
    return this.sessions.has(requestId);
  }

  /**
   * Sessions waiting for a worker, and places held by requests still being admitted (the admission
   * bound counts both).
   */
  get queuedCount(): number {
    return this.queued + this.reserved;
  }

  /**
   * Holds `count` queue places for a request between the admission bound's check and its sessions'
   * opening: the awaits in between (its tokenizer, its key's limits) let other requests pass the same
   * check meanwhile, so a key with limits could fill the queue past its bound. @returns the release
   * (call it once the sessions are open, or the request was refused)
   */
  reserveQueued(count: number): () => void {
    this.reserved += count;
    let released = false;
    return () => {
      if (released) return;
      released = true;
      this.reserved -= count;
    };
  }

  get size(): number {
    return this.sessions.size;
  }

  /**
   * @param options.nextSeq first entry the session wants (a resumed stream starts after its cursor)
   * @param options.graceMs how long the request outlives its client (see {@link clientLeft})
   * @param options.accepted a worker already accepted it (a resumed stream past its first entry)
   * @param options.scheduled with `accepted`: whether its engine scheduled it too (its log holds a
   *   `scheduled` entry or output; true when not given); false: it still waits for a place in the
   *   engine, under the queue timeout
   * @param options.workerId the worker running it (a resumed stream: the meta's), so that its loss
   *   migrates the stream as it would one opened here (its `accepted` entry is before the cursor)
   * @param options.attempt the attempt whose entries count (a resumed stream: the meta's)
   * @param options.owner the hash of the API key that made the request (see {@link endOwner})
   * @param options.takenOver its route moved here from elsewhere (a resume, a replay): its worker may
   *   still write to the old route for a moment (see {@link RequestSession.routeMoved})
   */
  open(
    requestId: string,
    deadlineAt: number,
    listener: (event: SessionEvent) => void,
    options: {
      nextSeq?: number;
      graceMs?: number;
      accepted?: boolean;
      scheduled?: boolean;
      workerId?: string | undefined;
      attempt?: number;
      owner?: string | undefined;
      takenOver?: boolean;
    } = {},
  ): RequestSession {
    const previous = this.sessions.get(requestId);
    if (previous !== undefined) {
      // A client resumed here while its earlier connection to this gateway still looks open: the new
      // connection takes the stream over; the old one ends without stopping the work.
      this.remove(previous);
      this.emit(previous, {
        type: 'superseded',
        error: new GatewayError('stream_interrupted', { message: 'The stream was resumed by another connection.' }),
      });
    }
    const session = new RequestSession(requestId, Date.now(), deadlineAt, listener, options.graceMs ?? 0);
    session.nextSeq = options.nextSeq ?? 0;
    session.attempt = options.attempt ?? 1;
    // (A resumed stream past its cursor: the continuations of its attempts so far are behind it.)
    session.continuedAttempt = session.attempt;
    session.owner = options.owner ?? '';
    session.routeMoved = options.takenOver ?? false;
    // '' is no worker (a cancel's synthetic `accepted`, a meta between attempts).
    if (options.workerId !== undefined && options.workerId !== '') session.workerId = options.workerId;
    this.sessions.set(requestId, session);
    if (options.accepted === true) {
      // A resumed stream past its `accepted`: it waits for entries, not for a worker. (Counted where
      // it started, not in this gateway's queue.) One its engine has not scheduled yet still waits for
      // a place there, under the queue timeout, and counts as waiting here until it is scheduled.
      session.state = 'running';
      session.scheduled = options.scheduled ?? true;
      if (!session.scheduled) this.queued++;
      session.acceptedAt = session.enqueuedAt;
    } else {
      this.queued++;
    }
    return session;
  }

  /** Routes one message from the gateway channel to its sessions. */
  dispatch(message: GatewayMessage): void {
    // One clock read per message, not per entry: a step's entries arrive together.
    const now = Date.now();
    for (const entry of message.entries) {
      const session = this.sessions.get(entry.requestId);
      if (session !== undefined) this.deliver(session, entry, false, now);
      // A late entry of a session that already ended: nothing waits for it, but a cancelled request
      // still publishing may have missed its cancel.
      else if (this.cancelled.size > 0) this.cancelAgain(entry);
    }
  }

  private cancelAgain(entry: GatewayEntry): void {
    const again = this.cancelled.stillRunning(entry.requestId, endsRequest(entry), Date.now());
    if (again === undefined) return;
    this.logger.warn({ requestId: entry.requestId, reason: again.reason }, 'a cancelled request still runs: cancelling it again');
    this.canceller.cancel(again.session, again.reason, false);
  }

  /**
   * Reads what the session missed from the token log and delivers it; live entries that arrive
   * meanwhile only note how far the stream got, and a read that leaves the session behind them runs
   * again. Fails the stream only when the log cannot fill the gap.
   */
  repair(session: RequestSession): void {
    if (session.repairing || session.state === 'closed') return;
    session.repairing = true;
    // Entries seen live before this read is issued were logged before they were published: the
    // read must return them, or the log lacks them. Entries seen during the read only call for another.
    const seenBefore = session.seenSeq;
    this.log.read(session.requestId, session.nextSeq).then(
      ({ entries, known }) => {
        session.repairing = false;
        this.deliverLogged(session, entries);
        if (session.state === 'closed') return;
        // A queued session may be repaired before its meta is even written (it opens first): nothing
        // is lost until a worker accepted it.
        if (!known && entries.length === 0 && session.state !== 'queued') {
          this.logger.warn({ requestId: session.requestId }, 'token log lost');
          this.fail(session, new GatewayError('stream_interrupted'), 'stream_failed');
        } else if (seenBefore >= session.nextSeq) {
          this.logger.warn(
            { requestId: session.requestId, expected: session.nextSeq, seen: seenBefore },
            'token log lacks entries seen live',
          );
          this.fail(session, new GatewayError('stream_interrupted'), 'stream_failed');
        } else if (session.seenSeq >= session.nextSeq) {
          this.repair(session);
        }
      },
      (error: unknown) => {
        session.repairing = false;
        // Redis away for a moment (its connection reconnecting): nothing is known lost, so read again
        // soon. The idle timeout bounds the retries, and an outage that outlasts a reconnect ends the
        // streams anyway (gateway.ts). (A failed read used to end the stream at once.)
        this.logger.warn({ err: error, requestId: session.requestId }, 'reading the token log failed: reading it again');
        setTimeout(() => this.repair(session), REPAIR_RETRY_MS).unref();
      },
    );
  }

  /**
   * Another gateway took the request's delivery over (its `route-moved` broadcast): a session still
   * open here (its first connection) reads the rest from the log.
   */
  routeMovedAway(requestId: string): void {
    const session = this.sessions.get(requestId);
    if (session !== undefined) session.routeMoved = true;
  }

  /**
   * A gateway moved the request to `attempt` without a session asking (its worker was lost before it
   * accepted it): live entries of older attempts are dropped from now on, as after this gateway's own
   * move — a worker that only looked dead may still publish some, and they are in no log.
   */
  attemptMoved(requestId: string, attempt: number): void {
    const session = this.sessions.get(requestId);
    if (session !== undefined && attempt > session.attempt) session.attempt = attempt;
  }

  /**
   * The subscriber reconnected: whatever was published meanwhile is in the logs. A `route-moved` sent
   * meanwhile is gone, so a session still waiting cannot tell whether its route moved away: it reads
   * its log while it waits from now on, as one told so does (reconnects are rare; reads stop once it
   * runs, where the sweep reads only quiet streams).
   */
  repairAll(): void {
    for (const session of [...this.sessions.values()]) {
      if (isWaiting(session)) session.routeMoved = true;
      this.repair(session);
    }
  }

  /** @param now when the entry arrived (ms since epoch) */
  private deliver(session: RequestSession, entry: GatewayEntry, fromLog: boolean, now: number): void {
    // Live entries of a superseded attempt (a worker taken for dead that came back) are fenced out;
    // the log holds only what each attempt wrote while it was current.
    if (!fromLog && ((entry.attempt ?? 1) < session.attempt || session.migrating)) return;
    // A newer attempt that a worker started on its own (a draining worker handed the request over):
    // from now on only its entries count.
    if ((entry.attempt ?? 1) > session.attempt) session.attempt = entry.attempt ?? 1;
    if (!fromLog && session.repairing) {
      session.seenSeq = Math.max(session.seenSeq, entry.seq);
      return;
    }
    // A continuation starts after the last entry of its log. One that starts (first seen: the same entry
    // may come again, live and from the log) before what this stream delivered means the live path ran
    // ahead of the log (appends Redis refused, out of memory, while their publishes went out): its
    // entries do not line up with what the client has, and delivering them by sequence number
    // duplicated text. The stream ends instead.
    if (
      entry.type === 'accepted' &&
      entry.continued === true &&
      (entry.attempt ?? 1) > session.continuedAttempt &&
      entry.seq < session.nextSeq
    ) {
      this.logger.warn(
        { requestId: session.requestId, continuedAt: entry.seq, delivered: session.nextSeq },
        'continuation behind the stream',
      );
      this.fail(session, new GatewayError('stream_interrupted'), 'stream_failed');
      return;
    }
    // An error ends the stream whatever came before it: a job BullMQ retried after its worker died
    // reports worker_lost from sequence 0 of its new attempt.
    const terminalError = entry.type === 'error' && !fromLog && entry.seq !== session.nextSeq;
    // Already delivered (from the log, or live before a repair read it again).
    if (entry.seq < session.nextSeq && !terminalError) return;
    if (entry.seq > session.nextSeq && !terminalError) {
      if (fromLog) {
        // The log itself lacks entries (trimmed, or Redis lost data): the answer cannot be completed.
        this.logger.warn({ requestId: session.requestId, expected: session.nextSeq, got: entry.seq }, 'token log has a gap');
        this.fail(session, new GatewayError('stream_interrupted'), 'stream_failed');
        return;
      }
      const gap = { requestId: session.requestId, expected: session.nextSeq, got: entry.seq };
      this.logger.info(gap, 'sequence gap: repairing from the token log');
      this.onGap(gap);
      session.seenSeq = Math.max(session.seenSeq, entry.seq);
      this.repair(session);
      return;
    }
    session.nextSeq = entry.seq + 1;
    session.lastEventAt = now;
    switch (entry.type) {
      case 'accepted':
        if (entry.continued === true) session.continuedAttempt = Math.max(session.continuedAttempt, entry.attempt ?? 1);
        // A worker holds it; it still waits (counted as queued) until its engine schedules it.
        session.state = 'running';
        session.workerId = entry.workerId;
        session.acceptedAt = session.lastEventAt;
        break;
      case 'scheduled':
        this.markScheduled(session);
        break;
      case 'rejected':
      case 'finish':
      case 'error':
        this.remove(session);
        break;
      default:
        // Output without a `scheduled` before it (a worker that does not send one): it runs.
        this.markScheduled(session);
        break;
    }
    this.emit(session, entry);
  }

  private markScheduled(session: RequestSession): void {
    if (session.scheduled || session.state !== 'running') return;
    session.scheduled = true;
    this.queued--;
  }

  /**
   * The client went away. Without a resume grace nobody wants the answer: the work stops. With one,
   * the request goes on into its log, and any gateway may resume it within the grace.
   * @returns whether the work goes on (detached)
   */
  clientLeft(session: RequestSession): boolean {
    if (session.state === 'closed') return false;
    if (session.graceMs === 0) {
      this.cancel(session, 'client_closed');
      return false;
    }
    this.remove(session);
    this.canceller.detach(session);
    return true;
  }

  /** The answer was delivered (or the responder gave up on its own): forget the session, cancel nothing. */
  release(session: RequestSession): void {
    this.remove(session);
  }

  /** Nobody wants the answer any more (client gone): stop the work. */
  cancel(session: RequestSession, reason: CancelReason): void {
    if (session.state === 'closed') return;
    const wasQueued = session.state === 'queued';
    this.remove(session);
    this.canceller.cancel(session, reason, wasQueued);
    this.cancelled.add(session, reason, Date.now());
  }

  /** Ends a session with a gateway-side error: its responder gets `failed`, the work is cancelled. */
  fail(session: RequestSession, error: GatewayError, reason: CancelReason): void {
    if (session.state === 'closed') return;
    this.cancel(session, reason);
    this.emit(session, { type: 'failed', error });
  }

  failAll(error: GatewayError, reason: CancelReason): void {
    for (const session of [...this.sessions.values()]) this.fail(session, error, reason);
  }

  /** The hashes of the API keys that own an open session ('' — no key — left out). */
  owners(): Set<string> {
    const owners = new Set<string>();
    for (const session of this.sessions.values()) if (session.owner !== '') owners.add(session.owner);
    return owners;
  }

  /**
   * The API key `owner` was revoked: each of its sessions ends with `error` (a 401 before the stream's
   * 200, an SSE error frame after it) and its work stops, as any failed session's does.
   * @returns how many sessions ended
   */
  endOwner(owner: string, error: GatewayError): number {
    let ended = 0;
    for (const session of [...this.sessions.values()]) {
      // (A session of a prompt batch may already be closed by its batch's first failure.)
      if (session.owner !== owner || session.state === 'closed') continue;
      this.fail(session, error, 'key_revoked');
      ended++;
    }
    return ended;
  }

  /**
   * This gateway stops with streams still open (its drain bound ran out): each ends with `error`. A
   * request with a resume grace is detached, not cancelled — it goes on into its log for its client
   * to resume on another gateway, as it would if this gateway had crashed; its `failed` says so
   * (`detached`), so its key's stream slot and token reservation stay held. The rest are cancelled.
   */
  shutDown(error: GatewayError): void {
    const resumable = new GatewayError(error.code, {
      message: `${error.message} The request goes on: resume its stream on another gateway (Last-Event-ID) within its resume grace.`,
    });
    for (const session of [...this.sessions.values()]) {
      if (session.state === 'closed') continue;
      if (session.graceMs === 0) {
        this.fail(session, error, 'shutdown');
        continue;
      }
      this.clientLeft(session);
      this.emit(session, { type: 'failed', error: resumable, detached: true });
    }
  }

  /**
   * Moves the streams of workers missing from a registry snapshot taken after they accepted to
   * another worker: the client sees a pause, then the rest of the same answer.
   */
  failLostWorkers(liveWorkerIds: ReadonlySet<string>, snapshotAt: number): void {
    for (const session of [...this.sessions.values()]) {
      if (
        session.state === 'running' &&
        session.workerId !== undefined &&
        session.acceptedAt < snapshotAt &&
        !liveWorkerIds.has(session.workerId)
      ) {
        this.logger.warn(
          { requestId: session.requestId, workerId: session.workerId, attempt: session.attempt },
          'worker stopped heartbeating: migrating',
        );
        this.migrate(session, session.workerId);
      }
    }
  }

  /**
   * While the move is decided, live entries are dropped (a worker that merely looked dead may still
   * publish); then the session takes the new attempt and reads the log, which holds every entry the
   * old attempt wrote before it was fenced out.
   */
  private migrate(session: RequestSession, lostWorkerId: string): void {
    session.workerId = undefined;
    session.migrating = true;
    this.canceller.migrate(session.requestId, session.attempt, lostWorkerId).then(
      (result) => {
        session.migrating = false;
        if (session.state === 'closed') return;
        if (result.outcome === 'exhausted' || result.outcome === 'gone') {
          this.endFromLog(session, result.outcome);
          return;
        }
        session.attempt = result.attempt;
        session.lastEventAt = Date.now();
        this.onMigrated(result.outcome === 'migrated');
        this.repair(session);
      },
      (error: unknown) => {
        session.migrating = false;
        if (session.state === 'closed') return;
        // Redis dropped or refused the move (a moment's outage, out of memory): nothing moved, so the
        // next registry poll tries again, and the idle timeout bounds the tries. (It used to end the
        // stream at once.)
        session.workerId = lostWorkerId;
        this.logger.warn(
          { err: error, requestId: session.requestId },
          'migrating a request failed: trying again at the next registry poll',
        );
      },
    );
  }

  /**
   * No move to make (the request's job is gone, or it used up its moves): its log may still end the
   * answer — a worker that wrote its last entry, then died (or only looked dead) before this stream
   * took that entry live. Delivers the log's rest; a stream it does not end gets `worker_lost`.
   */
  private endFromLog(session: RequestSession, outcome: 'exhausted' | 'gone'): void {
    const lost = (): void => {
      if (session.state === 'closed') return;
      this.logger.warn({ requestId: session.requestId, outcome }, 'cannot migrate the request');
      this.fail(session, new GatewayError('worker_lost'), 'stream_failed');
    };
    this.log.read(session.requestId, session.nextSeq).then(({ entries }) => {
      this.deliverLogged(session, entries);
      lost();
    }, lost);
  }

  /** Delivers entries read from the token log, in order, until one of them ends the stream. */
  private deliverLogged(session: RequestSession, entries: readonly GatewayEntry[]): void {
    const now = Date.now();
    for (const entry of entries) {
      if (session.state === 'closed') return;
      this.deliver(session, entry, true, now);
    }
  }

  /** Resolves once no session is open (graceful drain). */
  whenEmpty(): Promise<void> {
    if (this.sessions.size === 0) return Promise.resolve();
    return new Promise((resolve) => this.emptyWaiters.push(resolve));
  }

  close(): void {
    clearInterval(this.sweepTimer);
  }

  private tick(sweepMs: number): void {
    const now = Date.now();
    // The timer fired far later than asked: the process was stopped or its loop blocked meanwhile.
    if (now - this.lastTickAt > 2 * sweepMs + STALL_SLACK_MS) this.awakeSince = now;
    this.lastTickAt = now;
    this.sweep(now);
  }

  /** Runs the timeouts; exposed for tests. */
  sweep(now: number): void {
    this.cancelled.sweep(now);
    for (const session of [...this.sessions.values()]) {
      if (now >= session.deadlineAt) {
        this.fail(session, new GatewayError('deadline_exceeded'), 'timeout');
      } else if (isWaiting(session)) {
        // In the queue or inside an engine that has not scheduled it: the queue timeout applies (not
        // the idle one: nothing is generated yet).
        if (now - Math.max(session.enqueuedAt, this.awakeSince) >= this.options.queueTimeoutMs)
          this.fail(session, new GatewayError('queue_timeout'), 'timeout');
        // A stream whose route moved while it waited gets its entries elsewhere: taken over here, from a
        // worker that started the job just before the move and heard of it only after (it wrote to the
        // old route; an answer it finished meanwhile leaves nothing after it to reveal the gap); taken
        // over by another gateway, all of them. Either would wait out its queue timeout. (A stream on
        // its own route waits for live entries: its log is not read while it waits.)
        else if (session.routeMoved) this.repairIfQuiet(session, now);
      } else if (session.state === 'running' && now - Math.max(session.lastEventAt, this.awakeSince) >= this.options.idleTimeoutMs) {
        this.fail(session, new GatewayError('idle_timeout'), 'timeout');
      } else if (session.state === 'running') {
        this.repairIfQuiet(session, now);
      }
    }
  }

  /**
   * A stream quiet for a while may have missed its last entries with nothing after them to reveal the
   * gap (a message lost just as a route moved here): one cheap log read settles it.
   */
  private repairIfQuiet(session: RequestSession, now: number): void {
    if (now - session.lastEventAt < REPAIR_IDLE_MS || now - session.lastRepairAt < REPAIR_IDLE_MS) return;
    session.lastRepairAt = now;
    this.repair(session);
  }

  private remove(session: RequestSession): void {
    if (session.state === 'closed') return;
    if (isWaiting(session)) this.queued--;
    session.state = 'closed';
    if (this.sessions.get(session.requestId) === session) this.sessions.delete(session.requestId);
    if (this.sessions.size === 0 && this.emptyWaiters.length > 0) {
      const waiters = this.emptyWaiters;
      this.emptyWaiters = [];
      for (const resolve of waiters) resolve();
    }
  }

  private emit(session: RequestSession, event: SessionEvent): void {
    try {
      session.listener(event);
    } catch (error) {
      // One stream's failure must not break the demultiplexing of the others.
      this.logger.error({ err: error, requestId: session.requestId }, 'session listener failed');
    }
  }
}
