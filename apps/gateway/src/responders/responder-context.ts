import type { GatewayHooks, RequestOutcome } from '../hooks.js';
import { errorHeaders, GatewayError, toErrorBody } from '../errors.js';
import type { ParsedRequest } from '../openai/request-schemas.js';
import type { ResponseFormat } from '../openai/response-format.js';

/** What both responders (SSE and complete JSON) know about their request. */
export interface ResponderContext {
  requestId: string;
  request: ParsedRequest;
  format: ResponseFormat;
  /** When the gateway received the request (ms since epoch). */
  receivedAt: number;
  retryAfterS: number;
  hooks: GatewayHooks;
}

/** Names the logical field of a worker's error (`prompt`, `max_tokens`) as this endpoint calls it. */
export function paramRenamer(request: ParsedRequest): (param: string) => string {
  return (param) => {
    if (param === 'prompt') return request.endpoint === 'chat' ? 'messages' : 'prompt';
    if (param === 'max_tokens') return request.maxTokensParam;
    return param;
  };
}

export function errorResponse(error: GatewayError, retryAfterS: number): Response {
  return new Response(JSON.stringify(toErrorBody(error)), {
    status: error.status,
    headers: { 'Content-Type': 'application/json', ...errorHeaders(error, retryAfterS) },
  });
}

/** Reports the end of a request to the hooks, once. */
export class Outcome {
  private reported = false;
  promptTokens = 0;
  completionTokens = 0;

  constructor(private readonly ctx: ResponderContext) {}

  report(outcome: RequestOutcome, status: number, error?: GatewayError): void {
    if (this.reported) return;
    this.reported = true;
    const info = {
      requestId: this.ctx.requestId,
      outcome,
      status,
      e2eMs: Date.now() - this.ctx.receivedAt,
      promptTokens: this.promptTokens,
      completionTokens: this.completionTokens,
    };
    this.ctx.hooks.requestFinished?.(error === undefined ? info : { ...info, code: error.code });
  }
}
