import type { CancelReason } from '@sluice/protocol';
import type { RequestSession } from './request-session.js';

interface Cancelled {
  session: RequestSession;
  reason: CancelReason;
  cancelledAt: number;
  sentAt: number;
}

/**
 * The requests this gateway cancelled, for a while. A cancel is a pub/sub message: a worker whose
 * subscriber was reconnecting when it went out never hears it, and decodes the request to its end.
 * Its entries then keep arriving here for a request this gateway no longer holds; that is how the loss
 * shows, and the cancel goes out again (at most once per `resendMs`) until the request's last entry.
 */
export class CancelledRequests {
  readonly #cancelled = new Map<string, Cancelled>();

  /**
   * @param keepMs how long a cancel is remembered
   * @param resendMs the least time between two sends of one cancel (entries of the steps the worker ran
   *   before it heard the first are expected)
   */
  constructor(
    private readonly keepMs = 60_000,
    private readonly resendMs = 1_000,
  ) {}

  get size(): number {
    return this.#cancelled.size;
  }

  add(session: RequestSession, reason: CancelReason, now: number): void {
    this.#cancelled.delete(session.requestId);
    this.#cancelled.set(session.requestId, { session, reason, cancelledAt: now, sentAt: now });
  }

  /**
   * An entry arrived for a request this gateway holds no session of. @param last the entry ends the
   * request (its worker stopped it) @returns the cancel to send again, when the request is one this
   * gateway cancelled and the last send is `resendMs` old
   */
  stillRunning(requestId: string, last: boolean, now: number): { session: RequestSession; reason: CancelReason } | undefined {
    const cancelled = this.#cancelled.get(requestId);
    if (cancelled === undefined) return undefined;
    if (last) {
      this.#cancelled.delete(requestId);
      return undefined;
    }
    if (now - cancelled.sentAt < this.resendMs) return undefined;
    cancelled.sentAt = now;
    return cancelled;
  }

  /** Forgets cancels older than `keepMs` (the map is in the order they were made). */
  sweep(now: number): void {
    for (const [requestId, cancelled] of this.#cancelled) {
      if (now - cancelled.cancelledAt < this.keepMs) return;
      this.#cancelled.delete(requestId);
    }
  }
}
