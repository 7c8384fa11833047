import { z } from 'zod';
import { attemptJobId } from './names.js';

/** What a client-supplied `X-Request-Id` may be (else the gateway makes its own). */
export const REQUEST_ID_PATTERN = /^[\w.-]{1,128}$/;

/** One chat message, content already flattened to text by the gateway. */
export const chatMessageSchema = z.object({
  role: z.string(),
  content: z.string(),
  name: z.string().optional(),
});
export type JobChatMessage = z.infer<typeof chatMessageSchema>;

/** What to generate from: a chat (rendered with the model's template) or a raw prompt. */
export const jobInputSchema = z.discriminatedUnion('kind', [
  z.object({ kind: z.literal('chat'), messages: z.array(chatMessageSchema).min(1) }),
  z.object({ kind: z.literal('text'), prompt: z.string() }),
  z.object({ kind: z.literal('tokens'), promptTokenIds: z.array(z.number().int().nonnegative()) }),
]);
export type JobInput = z.infer<typeof jobInputSchema>;

/** Sampling and stopping parameters, engine semantics (OpenAI / vLLM). Absent = engine default. */
export const jobSamplingSchema = z.object({
  /** Absent: the worker uses the rest of the context (chat) or 16 (completions). */
  maxTokens: z.number().int().positive().optional(),
  temperature: z.number().min(0).optional(),
  topP: z.number().gt(0).max(1).optional(),
  topK: z.number().int().min(-1).optional(),
  minP: z.number().min(0).max(1).optional(),
  presencePenalty: z.number().optional(),
  frequencyPenalty: z.number().optional(),
  repetitionPenalty: z.number().positive().optional(),
  /** A safe integer (as the engine's generator and the token log take it): gateways hash a client's int64 past 2^53 into one. */
  seed: z.number().int().optional(),
  logprobs: z.boolean().optional(),
  topLogprobs: z.number().int().min(0).max(20).optional(),
  stop: z.array(z.string()).optional(),
  ignoreEos: z.boolean().optional(),
  /** `[tokenId, bias]` pairs (OpenAI's `logit_bias`), biases in [-100, 100]. */
  logitBias: z.array(z.tuple([z.number().int().min(0), z.number().min(-100).max(100)])).optional(),
  n: z.number().int().positive().optional(),
});
export type JobSampling = z.infer<typeof jobSamplingSchema>;

/** The data of one BullMQ generation job (stored in Redis in clear until the job finishes). */
export const generateJobSchema = z.object({
  /**
   * The gateway's unique id of this request: the BullMQ job id, the key of its pub/sub entries and
   * cancels.
   */
  requestId: z.string().min(1),
  /**
   * The id the client sees in `x-request-id` and both apps log as `requestId`: the client's (or the
   * load balancer's) `X-Request-Id` when it is valid, else the gateway's own. Not unique (a client
   * may reuse one), so never a key. Absent in jobs of older gateways.
   */
  correlationId: z.string().regex(REQUEST_ID_PATTERN).optional(),
  /** The gateway channel every message about this request goes to. */
  channel: z.string().min(1),
  model: z.string(),
  input: jobInputSchema,
  sampling: jobSamplingSchema,
  /** Default max tokens when `sampling.maxTokens` is absent: `'context'` = the rest of the context. */
  defaultMaxTokens: z.union([z.number().int().positive(), z.literal('context')]),
  /**
   * How long (ms) the request outlives its client's connection: detached, it decodes into its log until
   * a client resumes it or the grace runs out. 0: a client that leaves cancels the work at once.
   */
  resumeGraceMs: z.number().int().nonnegative().default(0),
  /**
   * Set on a continuation: the request's worker was lost, and this attempt goes on from the token ids
   * in its log (the job runs only while the request's meta still names this attempt).
   */
  continuation: z.object({ attempt: z.number().int().min(2) }).optional(),
  /** When the gateway enqueued the job (ms since epoch). */
  enqueuedAt: z.number(),
  /** After this instant (ms since epoch) nobody waits for the answer: a worker skips the job. */
  deadlineAt: z.number(),
});
export type GenerateJob = z.infer<typeof generateJobSchema>;

export function parseGenerateJob(data: unknown): GenerateJob {
  return generateJobSchema.parse(data);
}

/**
 * The job that carries a request on after its attempt ended elsewhere (a lost worker, a drain): the
 * same request, marked as attempt `attempt`, whose worker reads what was written from the token log.
 * @param channel where live entries go now; '' keeps the job's channel (a detached request: the next
 *   worker reads the meta, which has none, and runs it detached)
 */
export function continuationJob(job: GenerateJob, attempt: number, channel: string): GenerateJob {
  return { ...job, channel: channel === '' ? job.channel : channel, continuation: { attempt } };
}

/** BullMQ options of a continuation job: its attempt's own id, and ahead of new requests (a stream is under way). */
export function continuationJobOptions(requestId: string, attempt: number) {
  return { jobId: attemptJobId(requestId, attempt), lifo: true, removeOnComplete: true, removeOnFail: true, attempts: 1 } as const;
}

/**
 * A request's max_tokens: the client's, else its default — with `'context'`, the rest of the context
 * after the prompt, for each of its n choices within the KV cache they share (`maxCachedTokens`).
 * Gateways (to refuse before the 200) and workers (to run it) work it out alike.
 */
export function resolveMaxTokens(
  requested: number | undefined,
  defaultMaxTokens: GenerateJob['defaultMaxTokens'],
  limits: { promptTokens: number; maxContextLength: number; maxCachedTokens: number | undefined; n: number },
): number {
  if (requested !== undefined) return requested;
  if (defaultMaxTokens !== 'context') return defaultMaxTokens;
  const { promptTokens, maxContextLength, maxCachedTokens, n } = limits;
  const perChoice = maxCachedTokens === undefined ? maxContextLength : Math.min(maxContextLength, Math.floor(maxCachedTokens / n));
  return perChoice - promptTokens;
}
