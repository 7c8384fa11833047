import type { Endpoint } from './openai/request-schemas.js';

/** How a request ended, for metrics and logs. */
export type RequestOutcome = 'ok' | 'error' | 'cancelled';

/**
 * Seams for observability (metrics land on these later): called on the request path, synchronously,
 * and must be cheap and never throw.
 */
export interface GatewayHooks {
  requestStarted?(info: { requestId: string; endpoint: Endpoint; stream: boolean }): void;
  /** A worker accepted the request. */
  requestAccepted?(info: { requestId: string; queueMs: number }): void;
  /** The first text of the answer went out. */
  firstToken?(info: { requestId: string; ttftMs: number }): void;
  /** Text went out to the client; `gapMs` is the time since the previous text (absent for the first). */
  textDelivered?(info: { requestId: string; tokens: number; gapMs?: number }): void;
  requestFinished?(info: {
    requestId: string;
    outcome: RequestOutcome;
    /** GatewayError code when the outcome is `error`. */
    code?: string;
    status: number;
    e2eMs: number;
    promptTokens: number;
    completionTokens: number;
  }): void;
}
