import { z } from 'zod';

/** How a request's chunks look: what a gateway resuming the stream needs to write them the same way. */
export const streamFormatSchema = z.object({
  endpoint: z.enum(['chat', 'completion']),
  model: z.string(),
  /** The chunks' `created` (s since epoch): the same in every chunk, on every gateway. */
  created: z.number().int(),
  includeUsage: z.boolean(),
  n: z.number().int().positive(),
  /** The field the client used for the completion length (errors name it). */
  maxTokensParam: z.enum(['max_tokens', 'max_completion_tokens']),
  /** `stream_options.continuous_usage_stats`: every chunk carries the usage so far, resumed ones too. */
  continuousUsage: z.boolean().optional(),
  /**
   * A completions request with a batch of prompts: how many. Prompt k runs as request
   * `batchRequestId(id, k)`, each with this format; the batch's stream is not resumable.
   */
  prompts: z.number().int().min(2).optional(),
  /** Completions `echo`: the prompt's text, which each choice's stream starts with (a resume from the start writes it again). */
  echo: z.string().optional(),
});
export type StreamFormat = z.infer<typeof streamFormatSchema>;

/**
 * A request's state hash (`names.metaKey(id)`), written by the gateway at admission and kept by
 * whoever owns the request. Expires `STREAM_RETENTION_MS` after the request ends (and never later than
 * its deadline plus that).
 */
export const requestMetaSchema = z.object({
  /** Where live entries go now; empty while detached (its client left with a resume grace). */
  channel: z.string(),
  /** When the request was detached (ms since epoch); empty while attached. */
  detachedAt: z.coerce.number().optional(),
  /** How long the request may stay detached before it is cancelled. */
  graceMs: z.coerce.number().int().nonnegative(),
  /** The current attempt (worker epoch); only its entries enter the log. */
  attempt: z.coerce.number().int().positive(),
  enqueuedAt: z.coerce.number(),
  deadlineAt: z.coerce.number(),
  /** The worker running the current attempt (set by its `accepted` entry). */
  workerId: z.string().optional(),
  /**
   * The API key that made the request (its hash, as the key store names keys); absent when the
   * gateway ran without keys. Only the same key may resume or cancel the request.
   */
  owner: z.string().optional(),
  format: z.string().transform((raw, ctx) => {
    const parsed = streamFormatSchema.safeParse(safeJson(raw));
    if (!parsed.success) {
      ctx.addIssue({ code: 'custom', message: 'malformed stream format' });
      return z.NEVER;
    }
    return parsed.data;
  }),
});
export type RequestMeta = z.infer<typeof requestMetaSchema>;

function safeJson(raw: string): unknown {
  try {
    return JSON.parse(raw);
  } catch {
    return undefined;
  }
}

/** The hash fields of a new request's meta (`HSET key ...fields`). */
export function encodeRequestMeta(meta: Omit<RequestMeta, 'workerId' | 'detachedAt'>): Record<string, string> {
  return {
    channel: meta.channel,
    detachedAt: '',
    graceMs: String(meta.graceMs),
    attempt: String(meta.attempt),
    enqueuedAt: String(meta.enqueuedAt),
    deadlineAt: String(meta.deadlineAt),
    format: JSON.stringify(meta.format),
    owner: meta.owner ?? '',
  };
}

/** Parses an `HGETALL` reply; undefined when the hash is missing (expired, never existed) or malformed. */
export function decodeRequestMeta(hash: Record<string, string>): RequestMeta | undefined {
  if (Object.keys(hash).length === 0) return undefined;
  // Unset optional fields are stored as '' (HSET cannot unset a field in place).
  const cleaned = Object.fromEntries(Object.entries(hash).filter(([key, value]) => value !== '' || key === 'channel'));
  const result = requestMetaSchema.safeParse(cleaned);
  return result.success ? result.data : undefined;
}
