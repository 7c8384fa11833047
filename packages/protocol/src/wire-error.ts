import { z } from 'zod';

/**
 * Why a worker refused or ended a request. The gateway is the one place that turns these into HTTP
 * statuses and OpenAI error bodies; workers never send stack traces.
 */
export const wireErrorCodeSchema = z.enum([
  /** Prompt (+ max tokens) does not fit the model's context. */
  'context_length_exceeded',
  /** A parameter the engine refuses (the gateway validated ranges already). */
  'invalid_request',
  /** The job was retried after its first worker died mid-answer: the answer cannot be resumed. */
  'worker_lost',
  /** The worker is shutting down and ran out of drain time. */
  'worker_shutdown',
  /** Anything else that went wrong in the worker or engine. */
  'internal',
]);
export type WireErrorCode = z.infer<typeof wireErrorCodeSchema>;

export const wireErrorSchema = z.object({
  code: wireErrorCodeSchema,
  /** Safe to show to the client. */
  message: z.string(),
  /**
   * Logical request field at fault: `prompt` (the prompt or messages alone are too long) or
   * `max_tokens` (prompt + max tokens too long), or another request field name.
   */
  param: z.string().nullable(),
});
export type WireError = z.infer<typeof wireErrorSchema>;
