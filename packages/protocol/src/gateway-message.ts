import { z } from 'zod';
import { wireErrorSchema } from './wire-error.js';

/** One token's log probability, with the most likely alternatives when they were asked for. */
export const tokenLogprobSchema = z.object({
  token: z.string(),
  logprob: z.number(),
  /** UTF-8 bytes of the token (may be a partial character). */
  bytes: z.array(z.number().int()).optional(),
  top: z.array(z.object({ token: z.string(), logprob: z.number(), bytes: z.array(z.number().int()).optional() })).optional(),
});
export type TokenLogprobWire = z.infer<typeof tokenLogprobSchema>;

const entryBase = {
  requestId: z.string(),
  /**
   * Per-request sequence number: 0 for the first entry of a request, then +1 for each entry, carrying
   * on across attempts. It is the entry's id in the request's token log and the SSE cursor (`id:`).
   */
  seq: z.number().int().nonnegative(),
  /** The attempt (worker epoch) that wrote it; absent = 1. Entries of a superseded attempt are fenced out. */
  attempt: z.number().int().positive().optional(),
};

/** The worker took the job and the prompt fits: the gateway may send its 200. */
export const acceptedEntrySchema = z.object({
  ...entryBase,
  type: z.literal('accepted'),
  workerId: z.string(),
  promptTokens: z.number().int().nonnegative(),
  /** The sampling seed the request runs with (the worker picks one when the client did not): a continuation draws the same numbers. */
  seed: z.number().int().optional(),
  /** A continuation on another worker took the request over: the stream goes on (no new role chunk). */
  continued: z.boolean().optional(),
});

/**
 * The engine took the request out of its waiting queue (a row and KV space): its prefill starts.
 * Until then the request is queued, even on a worker that accepted it (queue time, queue_timeout and
 * the gateway's queued bound count it).
 */
export const scheduledEntrySchema = z.object({ ...entryBase, type: z.literal('scheduled') });

/** The worker refused the request before generating anything (the gateway answers with a 4xx). */
export const rejectedEntrySchema = z.object({ ...entryBase, type: z.literal('rejected'), error: wireErrorSchema });

/** New text of one choice (one engine step's worth, or less). */
export const textDeltaEntrySchema = z.object({
  ...entryBase,
  type: z.literal('text-delta'),
  index: z.number().int().nonnegative(),
  text: z.string(),
  /** Tokens this delta accounts for. */
  tokens: z.number().int().nonnegative(),
  /**
   * The sampled token ids of this delta and of earlier held-back ones (`tokens` of them): what a
   * continuation on another worker is rebuilt from. In the token log only: the live form a gateway
   * gets leaves them out ({@link encodeEntry}).
   */
  tokenIds: z.array(z.number().int().nonnegative()).optional(),
  logprobs: z.array(tokenLogprobSchema).optional(),
});

/** One choice finished. */
export const textEndEntrySchema = z.object({
  ...entryBase,
  type: z.literal('text-end'),
  index: z.number().int().nonnegative(),
  /** `abort`: cancelled (`POST .../{id}/cancel`, or its client left for good). */
  finishReason: z.enum(['stop', 'length', 'abort']),
});

/** The request finished; nothing follows. */
export const finishEntrySchema = z.object({
  ...entryBase,
  type: z.literal('finish'),
  usage: z.object({ promptTokens: z.number().int().nonnegative(), completionTokens: z.number().int().nonnegative() }),
});

/** The request failed after it was accepted; nothing follows. */
export const errorEntrySchema = z.object({ ...entryBase, type: z.literal('error'), error: wireErrorSchema });

export const gatewayEntrySchema = z.discriminatedUnion('type', [
  acceptedEntrySchema,
  scheduledEntrySchema,
  rejectedEntrySchema,
  textDeltaEntrySchema,
  textEndEntrySchema,
  finishEntrySchema,
  errorEntrySchema,
]);
export type GatewayEntry = z.infer<typeof gatewayEntrySchema>;
/** An entry before the publisher numbers it. */
export type GatewayEntryDraft = GatewayEntry extends infer E ? (E extends GatewayEntry ? Omit<E, 'seq'> : never) : never;

/** Whether an entry ends its request (`finish`, `error`, `rejected`): nothing follows it in the log. */
export function endsRequest(entry: Pick<GatewayEntry, 'type'>): boolean {
  return entry.type === 'finish' || entry.type === 'error' || entry.type === 'rejected';
}

/**
 * What a worker publishes on a gateway's channel: one message per engine step carrying the entries of
 * all that gateway's requests in the batch.
 */
export const gatewayMessageSchema = z.object({
  workerId: z.string(),
  entries: z.array(gatewayEntrySchema),
});
export type GatewayMessage = z.infer<typeof gatewayMessageSchema>;

export function encodeGatewayMessage(message: GatewayMessage): string {
  return JSON.stringify(message);
}

/** An entry serialized for a worker's two writes of it. */
export interface EncodedEntry {
  /** The token log's form: the whole entry. */
  logged: string;
  /**
   * The gateway channel's form: a text delta without its `tokenIds`. Only a continuation reads them, from
   * the log; on the channel every gateway would parse them for every token of every stream.
   */
  live: string;
}

/** Serializes an entry once for the log and the channel ({@link EncodedEntry}). */
export function encodeEntry(entry: GatewayEntry): EncodedEntry {
  if (entry.type !== 'text-delta' || entry.tokenIds === undefined) {
    const json = JSON.stringify(entry);
    return { logged: json, live: json };
  }
  const { tokenIds, ...rest } = entry;
  const live = JSON.stringify(rest);
  // An object's JSON ends with its closing brace: the ids go in as its last member.
  return { live, logged: `${live.slice(0, -1)},"tokenIds":${JSON.stringify(tokenIds)}}` };
}

/** A gateway channel message from entries in their live form ({@link encodeEntry}), in their order. */
export function liveGatewayMessage(workerId: string, liveEntries: readonly string[]): string {
  return `{"workerId":${JSON.stringify(workerId)},"entries":[${liveEntries.join(',')}]}`;
}

/**
 * Parses and validates a gateway channel message; throws on anything malformed.
 *
 * This runs for every step of every worker on the gateway's hot path, so `text-delta` entries without
 * logprobs (nearly all traffic) are checked by hand against the same rules as
 * {@link textDeltaEntrySchema}, without the copy a zod parse makes; every other entry goes through its
 * zod schema. `test/protocol.test.ts` checks that both paths accept and refuse the same inputs.
 */
export function decodeGatewayMessage(raw: string | Buffer): GatewayMessage {
  const message: unknown = JSON.parse(typeof raw === 'string' ? raw : raw.toString('utf8'));
  if (typeof message !== 'object' || message === null || Array.isArray(message)) return gatewayMessageSchema.parse(message);
  const { workerId, entries } = message as { workerId?: unknown; entries?: unknown };
  if (typeof workerId !== 'string' || !Array.isArray(entries)) return gatewayMessageSchema.parse(message);
  for (let i = 0; i < entries.length; i++) {
    const entry: unknown = entries[i];
    if (!isPlainTextDelta(entry)) entries[i] = gatewayEntrySchema.parse(entry);
  }
  return { workerId, entries: entries as GatewayEntry[] };
}

/** zod 4 `.int()` accepts safe integers only, so the fast path does too. */
const isCount = (value: unknown): boolean => typeof value === 'number' && Number.isSafeInteger(value) && value >= 0;

/** The rules of {@link textDeltaEntrySchema} for an entry without logprobs. */
function isPlainTextDelta(entry: unknown): boolean {
  if (typeof entry !== 'object' || entry === null) return false;
  const e = entry as Record<string, unknown>;
  return (
    e.type === 'text-delta' &&
    e.logprobs === undefined &&
    typeof e.requestId === 'string' &&
    typeof e.text === 'string' &&
    isCount(e.seq) &&
    isCount(e.index) &&
    isCount(e.tokens) &&
    (e.attempt === undefined || (isCount(e.attempt) && (e.attempt as number) > 0)) &&
    (e.tokenIds === undefined || (Array.isArray(e.tokenIds) && e.tokenIds.every(isCount)))
  );
}
