import { z } from 'zod';

export const cancelReasonSchema = z.enum([
  /** The client went away. */
  'client_closed',
  /** A queue, idle or deadline timeout of the gateway fired. */
  'timeout',
  /** The gateway saw a sequence gap or lost its worker and ended the stream. */
  'stream_failed',
  /** The gateway is shutting down and ran out of drain time. */
  'shutdown',
]);
export type CancelReason = z.infer<typeof cancelReasonSchema>;

/** Published by gateways on the cancel channel; the worker running a listed request aborts it. */
export const cancelMessageSchema = z.object({
  requestIds: z.array(z.string()).min(1),
  reason: cancelReasonSchema,
});
export type CancelMessage = z.infer<typeof cancelMessageSchema>;

export function encodeCancelMessage(message: CancelMessage): string {
  return JSON.stringify(message);
}

export function decodeCancelMessage(raw: string | Buffer): CancelMessage {
  return cancelMessageSchema.parse(JSON.parse(typeof raw === 'string' ? raw : raw.toString('utf8')));
}
