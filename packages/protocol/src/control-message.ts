import { z } from 'zod';

export const cancelReasonSchema = z.enum([
  /** The client went away (and its resume grace, if any, ran out). */
  'client_closed',
  /** A queue, idle or deadline timeout of the gateway fired. */
  'timeout',
  /** The gateway could not deliver the stream (the log lacks entries) and ended it. */
  'stream_failed',
  /** The gateway is shutting down and ran out of drain time. */
  'shutdown',
  /** `POST /v1/.../{id}/cancel`: the stream, if open, ends with finish reason `abort`. */
  'cancelled',
  /** The request's API key was revoked (`npm run keys -- revoke`): its stream, if open, ended with a 401 error. */
  'key_revoked',
]);
export type CancelReason = z.infer<typeof cancelReasonSchema>;

/**
 * A cancel reason as a worker reads it (a control message's, a cancel marker's value): one it does not
 * know (a newer gateway's, in a rolling upgrade) still cancels, as `cancelled`. Before, the whole
 * message was dropped, as workers older than `key_revoked` still drop that one.
 */
export const receivedCancelReasonSchema = cancelReasonSchema.catch('cancelled');

/**
 * Stop the listed requests. `channel` is the sending gateway's: a worker applies the cancel only while
 * the request's live entries still go there, so a gateway that lost its client to another gateway (a
 * resume) cannot cancel the resumed stream. Without `channel` (an API cancel) it always applies.
 */
export const cancelMessageSchema = z.object({
  type: z.literal('cancel'),
  requestIds: z.array(z.string()).min(1),
  reason: receivedCancelReasonSchema,
  channel: z.string().optional(),
});
export type CancelMessage = z.infer<typeof cancelMessageSchema>;

/**
 * Where a request's live entries go from now on. `channel: null` detaches the request (its client left
 * with a resume grace): entries only go to the log until someone attaches or the grace runs out. A
 * detach names the gateway it comes `from`, and applies only while the request still routes there.
 */
export const routeMessageSchema = z.object({
  type: z.literal('route'),
  requestId: z.string(),
  channel: z.string().nullable(),
  from: z.string().optional(),
});
export type RouteMessage = z.infer<typeof routeMessageSchema>;

/** Published by gateways on the control channel, read by every worker. */
export const controlMessageSchema = z.discriminatedUnion('type', [cancelMessageSchema, routeMessageSchema]);
export type ControlMessage = z.infer<typeof controlMessageSchema>;

export function encodeControlMessage(message: ControlMessage): string {
  return JSON.stringify(message);
}

export function decodeControlMessage(raw: string | Buffer): ControlMessage {
  return controlMessageSchema.parse(JSON.parse(typeof raw === 'string' ? raw : raw.toString('utf8')));
}

/**
 * An API key was revoked (`npm run keys -- revoke`): every gateway ends the requests it holds under
 * it. `keyHash` is the key's sha256 (hex): its id in Redis, and the `owner` of its requests' metas.
 */
export const keyRevokedMessageSchema = z.object({
  type: z.literal('key-revoked'),
  keyHash: z.string().regex(/^[0-9a-f]{64}$/),
});
export type KeyRevokedMessage = z.infer<typeof keyRevokedMessageSchema>;

/**
 * A gateway took a request's delivery over (a resume, a replay): its live entries go to `channel` from
 * now on. A gateway that still holds a session of it (its first connection, still open) no longer gets
 * them live, and reads them from the log instead.
 */
export const routeMovedMessageSchema = z.object({
  type: z.literal('route-moved'),
  requestId: z.string(),
  channel: z.string(),
});
export type RouteMovedMessage = z.infer<typeof routeMovedMessageSchema>;

/**
 * A gateway moved a request to a new attempt that no session of it asked for (its worker was lost
 * before it accepted the request: `RedisJobQueue.recoverLost`). Published by the move itself
 * (`MIGRATE_SCRIPT`), so it reaches a gateway ahead of anything the old attempt's worker (one that only
 * looked dead) still publishes: a session of the request drops live entries of older attempts from now on.
 */
export const attemptMovedMessageSchema = z.object({
  type: z.literal('attempt-moved'),
  requestId: z.string(),
  attempt: z.number().int().positive(),
});
export type AttemptMovedMessage = z.infer<typeof attemptMovedMessageSchema>;

/** Published on the gateways' channel (`gatewaysChannel`), read by every gateway. */
export const gatewayBroadcastSchema = z.discriminatedUnion('type', [
  keyRevokedMessageSchema,
  routeMovedMessageSchema,
  attemptMovedMessageSchema,
]);
export type GatewayBroadcast = z.infer<typeof gatewayBroadcastSchema>;

export function encodeGatewayBroadcast(message: GatewayBroadcast): string {
  return JSON.stringify(message);
}

export function decodeGatewayBroadcast(raw: string | Buffer): GatewayBroadcast {
  return gatewayBroadcastSchema.parse(JSON.parse(typeof raw === 'string' ? raw : raw.toString('utf8')));
}
