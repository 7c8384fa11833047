import type { GatewayEntry } from '@sluice/protocol';
import type { GatewayError } from './errors.js';

/**
 * What a session tells its responder: the worker's entries in order (sequence already checked), or a
 * failure the gateway itself decided (timeout, sequence gap, lost worker, shutdown).
 */
export type SessionEvent = GatewayEntry | { type: 'failed'; error: GatewayError };

export type SessionState = 'queued' | 'running' | 'closed';

/** The gateway side of one request: where it is, which worker has it, which entry comes next. */
export class RequestSession {
  state: SessionState = 'queued';
  workerId: string | undefined;
  /** Sequence number the next entry must carry. */
  nextSeq = 0;
  acceptedAt = 0;
  lastEventAt: number;

  constructor(
    readonly requestId: string,
    readonly enqueuedAt: number,
    readonly deadlineAt: number,
    readonly listener: (event: SessionEvent) => void,
  ) {
    this.lastEventAt = enqueuedAt;
  }
}
