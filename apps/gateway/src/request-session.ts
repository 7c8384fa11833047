import type { GatewayEntry } from '@sluice/protocol';
import type { GatewayError } from './errors.js';

/**
 * What a session tells its responder: the worker's entries in order (sequence already checked), a
 * failure the gateway itself decided (timeout, sequence gap, lost worker, shutdown), or that a resume
 * on this gateway took the stream over.
 * - `failed`, `detached`: the delivery ends but the work goes on (a draining gateway detached it for a
 *   resume elsewhere).
 * - `superseded`: a newer connection resumed the stream here; this one ends with `error` (the client's
 *   error frame) while the work goes on for the new one. Not a failure of the request.
 */
export type SessionEvent =
  GatewayEntry | { type: 'failed'; error: GatewayError; detached?: boolean } | { type: 'superseded'; error: GatewayError };

/** `queued`: in BullMQ's queue; `running`: a worker holds it (it may still wait inside the engine: see `scheduled`). */
export type SessionState = 'queued' | 'running' | 'closed';

/** Still waiting for a place in an engine: in the queue, or accepted by a worker whose engine has not scheduled it. */
export function isWaiting(session: RequestSession): boolean {
  return session.state === 'queued' || (session.state === 'running' && !session.scheduled);
}

/** The gateway side of one request: where it is, which worker has it, which entry comes next. */
export class RequestSession {
  state: SessionState = 'queued';
  workerId: string | undefined;
  /** sha256 of the API key that made the request ('' without keys): a revoke of that key ends it. */
  owner = '';
  /** Sequence number the next entry must carry. */
  nextSeq = 0;
  /** The attempt (worker epoch) whose entries count; older ones are fenced out. */
  attempt = 1;
  /** The newest attempt whose continuation (`accepted`, `continued`) this stream delivered or started past. */
  continuedAttempt = 1;
  /** Its worker was lost and the move to a new attempt is being decided: live entries are dropped. */
  migrating = false;
  /** A read of the token log is under way: live entries only note how far the stream got. */
  repairing = false;
  /** Highest sequence number seen live while a repair ran (or that revealed a gap). */
  seenSeq = -1;
  /**
   * Its live route moved, here from another gateway (a resume, a replay) or away to another: live
   * entries may go elsewhere, for a moment or for good, so the sweep reads its log while it waits too.
   */
  routeMoved = false;
  /** When an idle session last read its log (the sweep's safety net). */
  lastRepairAt = 0;
  acceptedAt = 0;
  /**
   * The engine took it out of its waiting queue (its `scheduled` entry, or any later one). Until then
   * a request a worker accepted is still waiting: queue time, queue_timeout and the queued bound
   * count it.
   */
  scheduled = false;
  lastEventAt: number;

  constructor(
    readonly requestId: string,
    readonly enqueuedAt: number,
    readonly deadlineAt: number,
    readonly listener: (event: SessionEvent) => void,
    /** How long the request outlives its client's connection (0: a client that leaves cancels it). */
    readonly graceMs = 0,
  ) {
    this.lastEventAt = enqueuedAt;
  }
}
