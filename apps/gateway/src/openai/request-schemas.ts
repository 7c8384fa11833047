import { z } from 'zod';
import type { JobChatMessage, JobInput, JobSampling } from '@sluice/protocol';
import { GatewayError } from '../errors.js';

/**
 * Zod schemas of the OpenAI request bodies the gateway accepts. Unknown fields are ignored (as vLLM
 * does); fields the engine cannot honour are refused with a 400 naming them. `null` means "unset",
 * as the OpenAI API treats it.
 */

const opt = <T extends z.ZodType>(schema: T) => schema.nullish().transform((value) => value ?? undefined);

const textPartSchema = z.object({ type: z.literal('text'), text: z.string() });

const messageSchema = z.object({
  role: z.enum(['system', 'developer', 'user', 'assistant', 'tool']),
  content: z.union([z.string(), z.array(textPartSchema)]).nullish(),
  name: opt(z.string()),
});

const stopSchema = opt(z.union([z.string(), z.array(z.string()).max(16)]));

/** Fields common to both endpoints. */
const commonFields = {
  model: z.string().min(1),
  stream: opt(z.boolean()),
  stream_options: opt(z.object({ include_usage: opt(z.boolean()) })),
  temperature: opt(z.number().min(0).max(2)),
  top_p: opt(z.number().gt(0).max(1)),
  top_k: opt(z.number().int().min(-1)),
  min_p: opt(z.number().min(0).max(1)),
  seed: opt(z.number().int()),
  stop: stopSchema,
  n: opt(z.number().int().min(1).max(16)),
  presence_penalty: opt(z.number().min(-2).max(2)),
  frequency_penalty: opt(z.number().min(-2).max(2)),
  repetition_penalty: opt(z.number().gt(0).max(2)),
  ignore_eos: opt(z.boolean()),
  user: opt(z.string()),
  max_tokens: opt(z.number().int().min(1)),
  /** Sluice: how long (ms) the request outlives its client's connection, resumable from any gateway. */
  resume_grace_ms: opt(z.number().int().min(0)),
};

/** Fields that would change the answer in ways the engine does not support: refused when set. */
const unsupported = {
  logit_bias: opt(z.record(z.string(), z.number()).refine((bias) => Object.keys(bias).length === 0, 'logit_bias is not supported')),
  tools: opt(z.array(z.unknown()).max(0, 'tools are not supported')),
  functions: opt(z.array(z.unknown()).max(0, 'functions are not supported')),
  response_format: opt(z.object({ type: z.literal('text', 'only response_format {"type":"text"} is supported') })),
};

export const chatRequestSchema = z.object({
  ...commonFields,
  ...unsupported,
  messages: z.array(messageSchema).min(1),
  max_completion_tokens: opt(z.number().int().min(1)),
  logprobs: opt(z.boolean()),
  top_logprobs: opt(z.number().int().min(0).max(20)),
});

const tokenIds = z.array(z.number().int().min(0)).min(1);

export const completionRequestSchema = z.object({
  ...commonFields,
  prompt: z.union([z.string(), z.array(z.string()).length(1), tokenIds, z.array(tokenIds).length(1)]),
  /** Completions API: how many most likely tokens to return per position (implies the sampled one). */
  logprobs: opt(z.number().int().min(0).max(20)),
  echo: opt(z.literal(false, 'echo is not supported')),
  suffix: opt(z.string().max(0, 'suffix is not supported')),
  best_of: opt(z.literal(1, 'best_of other than 1 is not supported')),
});

export type Endpoint = 'chat' | 'completion';

/** A validated request, in the shape the job and the response writers need. */
export interface ParsedRequest {
  endpoint: Endpoint;
  model: string;
  input: JobInput;
  sampling: JobSampling;
  defaultMaxTokens: number | 'context';
  stream: boolean;
  includeUsage: boolean;
  /** Number of choices. */
  n: number;
  logprobs: boolean;
  /** Field name the client used for the completion length (errors name it). */
  maxTokensParam: 'max_tokens' | 'max_completion_tokens';
  user: string | undefined;
  /** `resume_grace_ms` as sent (the gateway applies its default and cap). */
  resumeGraceMs: number | undefined;
}

/** `messages[0].content` style path of a zod issue: the `param` of the error body. */
function formatPath(path: readonly PropertyKey[]): string | null {
  let out = '';
  for (const part of path) {
    if (typeof part === 'number') out += `[${part}]`;
    else out += out === '' ? String(part) : `.${String(part)}`;
  }
  return out === '' ? null : out;
}

function valueAt(body: unknown, path: readonly PropertyKey[]): unknown {
  let value = body;
  for (const key of path) {
    if (typeof value !== 'object' || value === null) return undefined;
    value = (value as Record<PropertyKey, unknown>)[key];
  }
  return value;
}

function toInvalidRequest(error: z.ZodError, body: unknown): GatewayError {
  const issue = error.issues[0];
  if (issue === undefined) return new GatewayError('invalid_request');
  const param = formatPath(issue.path);
  const message = valueAt(body, issue.path) === undefined ? 'is required.' : issue.message;
  return new GatewayError('invalid_request', { message: param === null ? message : `${param}: ${message}`, param });
}

function parseWith<T extends z.ZodType>(schema: T, body: unknown): z.infer<T> {
  if (typeof body !== 'object' || body === null || Array.isArray(body)) {
    throw new GatewayError('invalid_request', { message: 'The request body must be a JSON object.' });
  }
  const result = schema.safeParse(body);
  if (!result.success) throw toInvalidRequest(result.error, body);
  return result.data;
}

function commonSampling(body: z.infer<typeof chatRequestSchema> | z.infer<typeof completionRequestSchema>): JobSampling {
  const sampling: JobSampling = {};
  if (body.temperature !== undefined) sampling.temperature = body.temperature;
  if (body.top_p !== undefined) sampling.topP = body.top_p;
  if (body.top_k !== undefined) sampling.topK = body.top_k;
  if (body.min_p !== undefined) sampling.minP = body.min_p;
  if (body.seed !== undefined) sampling.seed = body.seed;
  if (body.stop !== undefined) sampling.stop = typeof body.stop === 'string' ? [body.stop] : body.stop;
  if (body.n !== undefined) sampling.n = body.n;
  if (body.presence_penalty !== undefined) sampling.presencePenalty = body.presence_penalty;
  if (body.frequency_penalty !== undefined) sampling.frequencyPenalty = body.frequency_penalty;
  if (body.repetition_penalty !== undefined) sampling.repetitionPenalty = body.repetition_penalty;
  if (body.ignore_eos !== undefined) sampling.ignoreEos = body.ignore_eos;
  return sampling;
}

function streamFlags(body: { stream?: boolean | undefined; stream_options?: { include_usage?: boolean | undefined } | undefined }) {
  const stream = body.stream ?? false;
  if (!stream && body.stream_options !== undefined) {
    throw new GatewayError('invalid_request', {
      message: 'stream_options: only allowed when stream is true.',
      param: 'stream_options',
    });
  }
  return { stream, includeUsage: body.stream_options?.include_usage ?? false };
}

function flattenContent(content: string | Array<{ text: string }> | null | undefined): string {
  if (content === null || content === undefined) return '';
  return typeof content === 'string' ? content : content.map((part) => part.text).join('');
}

export function parseChatRequest(body: unknown): ParsedRequest {
  const req = parseWith(chatRequestSchema, body);
  const sampling = commonSampling(req);
  const maxTokensParam = req.max_completion_tokens !== undefined ? 'max_completion_tokens' : 'max_tokens';
  const maxTokens = req.max_completion_tokens ?? req.max_tokens;
  if (maxTokens !== undefined) sampling.maxTokens = maxTokens;
  if (req.top_logprobs !== undefined && req.top_logprobs > 0 && req.logprobs !== true) {
    throw new GatewayError('invalid_request', {
      message: 'top_logprobs: requires logprobs to be true.',
      param: 'top_logprobs',
    });
  }
  if (req.logprobs === true) {
    sampling.logprobs = true;
    sampling.topLogprobs = req.top_logprobs ?? 0;
  }
  const messages: JobChatMessage[] = req.messages.map((m) => {
    const message: JobChatMessage = { role: m.role, content: flattenContent(m.content) };
    if (m.name !== undefined) message.name = m.name;
    return message;
  });
  return {
    endpoint: 'chat',
    model: req.model,
    input: { kind: 'chat', messages },
    sampling,
    defaultMaxTokens: 'context',
    ...streamFlags(req),
    n: req.n ?? 1,
    logprobs: req.logprobs === true,
    maxTokensParam,
    user: req.user,
    resumeGraceMs: req.resume_grace_ms,
  };
}

export function parseCompletionRequest(body: unknown): ParsedRequest {
  const req = parseWith(completionRequestSchema, body);
  const sampling = commonSampling(req);
  if (req.max_tokens !== undefined) sampling.maxTokens = req.max_tokens;
  if (req.logprobs !== undefined) {
    sampling.logprobs = true;
    sampling.topLogprobs = req.logprobs;
  }
  const prompt = Array.isArray(req.prompt) ? req.prompt[0] : req.prompt;
  let input: JobInput;
  if (typeof prompt === 'string') input = { kind: 'text', prompt };
  else if (typeof prompt === 'number') input = { kind: 'tokens', promptTokenIds: req.prompt as number[] };
  else input = { kind: 'tokens', promptTokenIds: prompt as number[] };
  return {
    endpoint: 'completion',
    model: req.model,
    input,
    sampling,
    // The legacy completions API stops at 16 tokens unless told otherwise.
    defaultMaxTokens: 16,
    ...streamFlags(req),
    n: req.n ?? 1,
    logprobs: req.logprobs !== undefined,
    maxTokensParam: 'max_tokens',
    user: req.user,
    resumeGraceMs: req.resume_grace_ms,
  };
}
