import type { GatewayHooks, RequestEnd, RequestObserver } from '../hooks.js';
import { errorHeaders, type GatewayError, toErrorBody } from '../errors.js';
import type { ParsedRequest } from '../openai/request-schemas.js';
import type { ResponseFormat } from '../openai/response-format.js';
import type { RequestTiming } from './request-timing.js';

/** What both responders (SSE and complete JSON) know about their request. */
export interface ResponderContext {
  /** The id the client sees in `x-request-id` (its own `X-Request-Id` when valid). */
  requestId: string;
  request: ParsedRequest;
  format: ResponseFormat;
  /** When the gateway received the request (ms since epoch). */
  receivedAt: number;
  retryAfterS: number;
  hooks: GatewayHooks;
  observer: RequestObserver;
  /** The spans the reply's `Server-Timing` header reports (none on a resumed stream). */
  timing?: RequestTiming;
}

/** Names the logical field of a worker's error (`prompt`, `max_tokens`) as this endpoint calls it. */
export function paramRenamer(request: ParsedRequest): (param: string) => string {
  return (param) => {
    if (param === 'prompt') return request.endpoint === 'chat' ? 'messages' : 'prompt';
    if (param === 'max_tokens') return request.maxTokensParam;
    return param;
  };
}

export function errorResponse(error: GatewayError, retryAfterS: number, requestId: string): Response {
  return new Response(JSON.stringify(toErrorBody(error)), {
    status: error.status,
    headers: { 'Content-Type': 'application/json', 'X-Request-Id': requestId, ...errorHeaders(error, retryAfterS) },
  });
}

const NO_OBSERVER: RequestObserver = { accepted() {}, scheduled() {}, contentWritten() {}, tokensWithoutText() {}, finished() {} };

/** The observer of a request with no hooks (tests, benchmarks). */
export function noObserver(): RequestObserver {
  return NO_OBSERVER;
}

/** A gateway error as a request end: the three timeouts by kind, anything else as an error. */
export function errorEnd(error: GatewayError): RequestEnd {
  switch (error.code) {
    case 'queue_timeout':
      return { outcome: 'timeout', kind: 'queue', code: error.code };
    case 'idle_timeout':
      return { outcome: 'timeout', kind: 'idle', code: error.code };
    case 'deadline_exceeded':
      return { outcome: 'timeout', kind: 'deadline', code: error.code };
    default:
      return { outcome: 'error', code: error.code };
  }
}

/**
 * The end a gateway-side failure reports: {@link errorEnd}, marked `detached` when the work goes on
 * (a draining gateway left it to a resume elsewhere).
 */
export function failedEnd(error: GatewayError, detached: boolean): RequestEnd {
  const end = errorEnd(error);
  return detached && end.outcome === 'error' ? { ...end, detached } : end;
}

/** How a delivery taken over by a resume on this gateway ended: its client's connection is replaced, its work goes on. */
export const SUPERSEDED_END: RequestEnd = { outcome: 'disconnect', detached: true };

/** Reports the end of a request to its observer, once, with the token counts the responder saw. */
export class Outcome {
  private reported = false;
  promptTokens = 0;
  completionTokens = 0;

  constructor(private readonly ctx: ResponderContext) {}

  report(end: RequestEnd, status: number): void {
    if (this.reported) return;
    this.reported = true;
    this.ctx.observer.finished({
      end,
      status,
      promptTokens: this.promptTokens,
      completionTokens: this.completionTokens,
    });
  }
}
