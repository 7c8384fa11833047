import type { WireError } from '@sluice/protocol';

/** Every reason the gateway refuses or ends a request. */
export type GatewayErrorCode =
  | 'invalid_json'
  | 'invalid_request'
  | 'request_too_large'
  | 'headers_too_large'
  | 'bad_http_request'
  | 'request_timeout'
  | 'client_closed'
  | 'client_too_slow'
  | 'not_found'
  | 'method_not_allowed'
  | 'model_not_found'
  | 'context_length_exceeded'
  | 'queue_full'
  | 'no_workers'
  | 'shutting_down'
  | 'queue_timeout'
  | 'idle_timeout'
  | 'deadline_exceeded'
  | 'worker_lost'
  | 'worker_shutdown'
  | 'stream_interrupted'
  | 'internal'
  // Access control (auth/*).
  | 'invalid_api_key'
  | 'model_not_allowed'
  | 'rate_limit_exceeded'
  | 'tokens_over_key_limit'
  | 'unsupported_media_type'
  // Idempotency-Key (idempotency-store.ts).
  | 'idempotency_key_reused'
  | 'idempotency_conflict'
  // Redis (queue, registry, stream log, keys, limits) did not answer.
  | 'store_unavailable';

interface CodeInfo {
  status: number;
  type: string;
  message: string;
  /** Send Retry-After with the HTTP reply. */
  retry?: boolean;
}

const codes: Record<GatewayErrorCode, CodeInfo> = {
  invalid_json: { status: 400, type: 'invalid_request_error', message: 'The request body is not valid JSON.' },
  invalid_request: { status: 400, type: 'invalid_request_error', message: 'Invalid request.' },
  request_too_large: { status: 413, type: 'invalid_request_error', message: 'The request body is too large.' },
  headers_too_large: { status: 431, type: 'invalid_request_error', message: 'The request headers are too large.' },
  bad_http_request: { status: 400, type: 'invalid_request_error', message: 'The request is not valid HTTP/1.1.' },
  request_timeout: { status: 408, type: 'invalid_request_error', message: 'The request was not received in time.' },
  // nginx's 499: the client closed its connection before the request was read (nobody gets the reply).
  client_closed: { status: 499, type: 'invalid_request_error', message: 'The client closed the connection.' },
  // Only ever an SSE error frame (the 200 went out): the client stopped reading its stream.
  client_too_slow: { status: 408, type: 'invalid_request_error', message: 'The client did not read its stream.' },
  not_found: { status: 404, type: 'invalid_request_error', message: 'Not found.' },
  method_not_allowed: { status: 405, type: 'invalid_request_error', message: 'Method not allowed.' },
  model_not_found: { status: 404, type: 'invalid_request_error', message: 'The model does not exist.' },
  context_length_exceeded: {
    status: 400,
    type: 'invalid_request_error',
    message: "The request does not fit the model's context length.",
  },
  queue_full: {
    status: 429,
    type: 'rate_limit_error',
    message: 'Too many requests are waiting for a worker. Retry later.',
    retry: true,
  },
  no_workers: { status: 503, type: 'server_error', message: 'No worker is available.', retry: true },
  store_unavailable: { status: 503, type: 'server_error', message: 'Redis is unavailable.', retry: true },
  shutting_down: { status: 503, type: 'server_error', message: 'The gateway is shutting down.', retry: true },
  queue_timeout: {
    status: 503,
    type: 'server_error',
    message: 'The request waited too long for a worker.',
    retry: true,
  },
  idle_timeout: { status: 504, type: 'server_error', message: 'The worker sent nothing for too long.' },
  deadline_exceeded: { status: 504, type: 'server_error', message: 'The request exceeded its deadline.' },
  worker_lost: { status: 502, type: 'server_error', message: 'The worker serving the request stopped.' },
  worker_shutdown: { status: 503, type: 'server_error', message: 'The worker shut down before finishing.', retry: true },
  stream_interrupted: {
    status: 502,
    type: 'server_error',
    message: 'Part of the answer was lost between the worker and the gateway.',
  },
  internal: { status: 500, type: 'server_error', message: 'Internal error.' },
  invalid_api_key: { status: 401, type: 'invalid_request_error', message: 'Missing or invalid API key.' },
  model_not_allowed: { status: 403, type: 'invalid_request_error', message: 'This API key may not use this model.' },
  rate_limit_exceeded: { status: 429, type: 'rate_limit_error', message: 'Rate limit reached for this API key.', retry: true },
  // Not a 429: the request can never pass under the key's budget, so no client should retry it.
  tokens_over_key_limit: {
    status: 400,
    type: 'invalid_request_error',
    message: "This request may use more tokens than this API key's tokens-per-minute limit.",
  },
  // The key named a request with another body or route: the same key must not stand for two requests.
  idempotency_key_reused: {
    status: 422,
    type: 'invalid_request_error',
    message: 'This Idempotency-Key was used for a request with another body or route.',
  },
  // The key's request is still being admitted by another gateway (or that gateway died doing so).
  idempotency_conflict: {
    status: 409,
    type: 'invalid_request_error',
    message: 'A request with this Idempotency-Key is being admitted. Retry later.',
    retry: true,
  },
  unsupported_media_type: {
    status: 415,
    type: 'invalid_request_error',
    message: 'The request body must be application/json.',
  },
};

/** Every error code with its HTTP status and OpenAI error type: what `GET /openapi.json` documents. */
export const errorCodeTable: Readonly<Record<GatewayErrorCode, Readonly<CodeInfo>>> = codes;

/** The gateway's one error type: a code, a client-safe message and the request field at fault. */
export class GatewayError extends Error {
  override name = 'GatewayError';
  readonly status: number;
  readonly type: string;
  readonly param: string | null;
  readonly retryAfter: boolean;
  /** Headers the HTTP reply must carry (a 405's `Allow`). */
  readonly headers: Readonly<Record<string, string>>;
  /** Retry-After in seconds when this error knows it (a rate limit's reset), else the configured one. */
  readonly retryAfterS: number | undefined;

  constructor(
    readonly code: GatewayErrorCode,
    options: { message?: string; param?: string | null; cause?: unknown; headers?: Record<string, string>; retryAfterS?: number } = {},
  ) {
    const info = codes[code];
    super(options.message ?? info.message, options.cause === undefined ? undefined : { cause: options.cause });
    this.status = info.status;
    this.type = info.type;
    this.param = options.param ?? null;
    this.retryAfter = info.retry === true;
    this.headers = options.headers ?? {};
    this.retryAfterS = options.retryAfterS;
  }
}

export interface OpenAIErrorBody {
  error: { message: string; type: string; param: string | null; code: string };
}

/** The one mapping point: any thrown value → a GatewayError (internal details never reach a client). */
export function toGatewayError(error: unknown): GatewayError {
  return error instanceof GatewayError ? error : new GatewayError('internal', { cause: error });
}

/** A read or write of the stream store: Redis failing it is a 503 `store_unavailable` to retry (it was a 500 `internal`). */
export async function fromStore<T>(work: Promise<T>): Promise<T> {
  try {
    return await work;
  } catch (cause) {
    throw new GatewayError('store_unavailable', { message: 'The stream store is unavailable: try again.', cause });
  }
}

/** OpenAI error body, used both for the HTTP reply and for the SSE error frame. */
export function toErrorBody(error: GatewayError): OpenAIErrorBody {
  return { error: { message: error.message, type: error.type, param: error.param, code: error.code } };
}

/** The SSE frames that end a stream that already sent its 200: the error, then `[DONE]`. */
export function toSseErrorFrames(error: GatewayError): string {
  return `data: ${JSON.stringify(toErrorBody(error))}\n\ndata: [DONE]\n\n`;
}

/** HTTP headers that go with an error reply. */
export function errorHeaders(error: GatewayError, retryAfterS: number): Record<string, string> {
  return error.retryAfter ? { ...error.headers, 'Retry-After': String(error.retryAfterS ?? retryAfterS) } : { ...error.headers };
}

/**
 * Maps a worker's error to the gateway's. `param` is a logical field (`prompt`, `max_tokens`) that the
 * endpoint renames to the field the client actually sent.
 */
export function fromWireError(error: WireError, renameParam: (param: string) => string): GatewayError {
  const param = error.param === null ? null : renameParam(error.param);
  switch (error.code) {
    case 'context_length_exceeded':
      return new GatewayError('context_length_exceeded', { message: error.message, param });
    case 'invalid_request':
      return new GatewayError('invalid_request', { message: error.message, param });
    case 'worker_lost':
      return new GatewayError('worker_lost');
    case 'worker_shutdown':
      return new GatewayError('worker_shutdown');
    case 'internal':
      return new GatewayError('internal');
  }
}
