import type { Endpoint } from './openai/request-schemas.js';

/** Kinds of SSE frames, counted apart so heartbeats do not hide in the content traffic. */
export type SseFrameKind = 'chunk' | 'heartbeat' | 'error' | 'done';

/**
 * How an accepted request's delivery ended. `stop`/`length` are complete answers; the rest say why
 * not. `detached` (on the endings that may have it): this delivery ended but the work goes on — within
 * the request's resume grace, or taken over by a resume — so what the request holds (its key's stream
 * slot and token reservation) stays held.
 */
export type RequestEnd =
  | { outcome: 'stop' | 'length' }
  /** Ended by `POST .../{id}/cancel`: its choices finished with reason `abort`. */
  | { outcome: 'cancelled' }
  /**
   * The client left; `detached`: the request goes on within its resume grace (also a stream taken over
   * by a resume on this gateway while its connection was still open).
   */
  | { outcome: 'disconnect'; detached?: boolean }
  | { outcome: 'timeout'; kind: 'queue' | 'idle' | 'deadline'; code: string }
  /** The client did not read: its buffer bound (`buffer`) or stall timeout (`stall`) ended the stream. */
  | { outcome: 'slow_client'; cause: 'buffer' | 'stall'; detached?: boolean }
  /** `detached`: a draining gateway ended the stream (`shutting_down`) and left the work to a resume elsewhere. */
  | { outcome: 'error'; code: string; detached?: boolean };

/** Whether the work of a delivery that ended so goes on (see {@link RequestEnd}). */
export function workGoesOn(end: RequestEnd): boolean {
  return 'detached' in end && end.detached === true;
}

export interface RequestFinishedInfo {
  end: RequestEnd;
  /** HTTP status the client got (499 when it left before any status went out). */
  status: number;
  promptTokens: number;
  /** Completion tokens written to the client (all choices). */
  completionTokens: number;
}

/**
 * One accepted request's observer (metrics + the per-request log line). The first `finished` ends it;
 * later calls are ignored.
 */
export interface RequestObserver {
  /** The job is in the queue (its meta written, BullMQ's add answered): a span of the TTFT breakdown. */
  enqueued?(): void;
  /** The worker's `accepted` arrived (a span of the TTFT breakdown). */
  accepted(): void;
  /** The engine scheduled the request (its `scheduled` entry): queue time ends. */
  scheduled(): void;
  /** One delta message carrying `tokens` completion tokens was written (or collected) for the client. */
  contentWritten(tokens: number): void;
  /** Tokens that came with no visible text (held back by the worker's detokenizer to the end). */
  tokensWithoutText(tokens: number): void;
  finished(info: RequestFinishedInfo): void;
}

/**
 * Seams for observability, called on the request path, synchronously: they must be cheap and never
 * throw. `apps/gateway/src/gateway-observer.ts` implements them with `@sluice/metrics` and pino.
 */
export interface GatewayHooks {
  /** The server took an HTTP request (any route): the gateway has work until the returned function is called, when its response closes. */
  httpRequestOpened?: () => () => void;
  /** One HTTP response, by route pattern (never the raw path) and status. */
  responded?: (route: string, status: number) => void;
  /** A request refused by the gateway before any work started, by error code (`queue_full` is the 429). */
  rejected?(code: string): void;
  /**
   * `frames` SSE frames of `bytes` UTF-8 bytes went out in one write. Runs per write per client: keep
   * it to counter increments.
   */
  sseWritten?: (kind: SseFrameKind, bytes: number, frames: number) => void;
  /**
   * A resumed stream wrote `tokens` completion tokens (its request is counted where it started; the
   * tokens written here are written to a client all the same).
   */
  resumedTokensWritten?(tokens: number): void;
  /** A stream's worker was lost and the request moved to another worker (`byThisGateway`: this gateway moved it). */
  streamMigrated?(byThisGateway: boolean): void;
  /** A client resumed a stream here (`GET .../{id}?stream=true`). */
  streamResumed?(): void;
  /**
   * A POST came again with an `Idempotency-Key` that names a request already admitted: its reply is
   * delivered here from the request's log, as a resume from the start (`stream`: as SSE).
   */
  requestReplayed?(stream: boolean): void;
  /** A resumed stream is open here: an active stream until the returned function is called (once or more). */
  resumedStreamOpened?(): () => void;
  /** Entries of a request were lost between worker and gateway (a sequence gap, repaired from the token log). */
  streamGap?(info: { requestId: string; expected: number; got: number }): void;
  /**
   * A request was validated and admitted and is about to be enqueued. `receivedAt` is on the
   * `performance.now()` clock, taken before the body was read.
   */
  requestStarted?(info: {
    requestId: string;
    jobId: string;
    endpoint: Endpoint;
    model: string;
    stream: boolean;
    receivedAt: number;
  }): RequestObserver;
}
