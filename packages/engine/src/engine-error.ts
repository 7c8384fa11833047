import type { EngineErrorCode } from './types.js';

/**
 * The engine's one error type. `code` says what went wrong in a way a caller can map to a status
 * (`context_length_exceeded` and `invalid_request` are the caller's fault, the rest are not); the
 * message names the field or the numbers involved and never carries a stack from the engine thread.
 */
export class EngineError extends Error {
  override readonly name = 'EngineError';
  readonly code: EngineErrorCode;

  constructor(code: EngineErrorCode, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.code = code;
  }
}
