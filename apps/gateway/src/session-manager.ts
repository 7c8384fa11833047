import type { CancelReason, GatewayMessage } from '@sluice/protocol';
import type { Logger } from 'pino';
import { GatewayError } from './errors.js';
import { RequestSession, type SessionEvent } from './request-session.js';

/** Stops the work of a request that nobody waits for any more. */
export interface WorkCanceller {
  cancel(session: RequestSession, reason: CancelReason, wasQueued: boolean): void;
}

export interface SessionManagerOptions {
  /** Max time from enqueue to the worker's accept. */
  queueTimeoutMs: number;
  /** Max time between entries once accepted. */
  idleTimeoutMs: number;
}

/**
 * The demultiplexer's table: request id → session. Checks every entry's sequence number, runs the
 * queue / idle / deadline timeouts from one sweep timer, and fails the streams of workers that
 * stopped heartbeating. Every way a session ends goes through here, so work is cancelled exactly when
 * the answer is no longer wanted.
 */
export class SessionManager {
  private readonly sessions = new Map<string, RequestSession>();
  private queued = 0;
  private readonly sweepTimer: NodeJS.Timeout;
  private emptyWaiters: Array<() => void> = [];

  constructor(
    private readonly options: SessionManagerOptions,
    private readonly canceller: WorkCanceller,
    private readonly logger: Logger,
    /** Told of every sequence gap (metrics). */
    private readonly onGap: (info: { requestId: string; expected: number; got: number }) => void = () => {},
  ) {
    const sweepMs = Math.max(10, Math.min(500, Math.floor(Math.min(options.queueTimeoutMs, options.idleTimeoutMs) / 10)));
    this.sweepTimer = setInterval(() => this.sweep(Date.now()), sweepMs);
    this.sweepTimer.unref();
  }

  /** Sessions waiting for a worker (the admission bound counts these). */
  get queuedCount(): number {
    return this.queued;
  }

  get size(): number {
    return this.sessions.size;
  }

  open(requestId: string, deadlineAt: number, listener: (event: SessionEvent) => void): RequestSession {
    const session = new RequestSession(requestId, Date.now(), deadlineAt, listener);
    this.sessions.set(requestId, session);
    this.queued++;
    return session;
  }

  /** Routes one message from the gateway channel to its sessions. */
  dispatch(message: GatewayMessage): void {
    const now = Date.now();
    for (const entry of message.entries) {
      const session = this.sessions.get(entry.requestId);
      // A late entry of a session that already ended (cancelled, timed out): nothing waits for it.
      if (session === undefined) continue;
      // An error ends the stream whatever came before it, and says why better than a gap would: a
      // job retried after its worker died reports worker_lost from sequence 0 of its new attempt.
      if (entry.seq !== session.nextSeq && entry.type !== 'error') {
        const gap = { requestId: session.requestId, expected: session.nextSeq, got: entry.seq };
        this.logger.warn(gap, 'sequence gap');
        this.onGap(gap);
        this.fail(session, new GatewayError('stream_interrupted'), 'stream_failed');
        continue;
      }
      session.nextSeq++;
      session.lastEventAt = now;
      switch (entry.type) {
        case 'accepted':
          if (session.state === 'queued') this.queued--;
          session.state = 'running';
          session.workerId = entry.workerId;
          session.acceptedAt = now;
          break;
        case 'rejected':
        case 'finish':
        case 'error':
          this.remove(session);
          break;
        default:
          break;
      }
      this.emit(session, entry);
    }
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

  /** Fails the streams of workers missing from a registry snapshot taken after they accepted. */
  failLostWorkers(liveWorkerIds: ReadonlySet<string>, snapshotAt: number): void {
    for (const session of [...this.sessions.values()]) {
      if (
        session.state === 'running' &&
        session.workerId !== undefined &&
        session.acceptedAt < snapshotAt &&
        !liveWorkerIds.has(session.workerId)
      ) {
        this.logger.warn({ requestId: session.requestId, workerId: session.workerId }, 'worker stopped heartbeating');
        this.fail(session, new GatewayError('worker_lost'), 'stream_failed');
      }
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

  /** Runs the timeouts; exposed for tests. */
  sweep(now: number): void {
    for (const session of [...this.sessions.values()]) {
      if (now >= session.deadlineAt) {
        this.fail(session, new GatewayError('deadline_exceeded'), 'timeout');
      } else if (session.state === 'queued' && now - session.enqueuedAt >= this.options.queueTimeoutMs) {
        this.fail(session, new GatewayError('queue_timeout'), 'timeout');
      } else if (session.state === 'running' && now - session.lastEventAt >= this.options.idleTimeoutMs) {
        this.fail(session, new GatewayError('idle_timeout'), 'timeout');
      }
    }
  }

  private remove(session: RequestSession): void {
    if (session.state === 'closed') return;
    if (session.state === 'queued') this.queued--;
    session.state = 'closed';
    this.sessions.delete(session.requestId);
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
