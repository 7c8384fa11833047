import { z } from 'zod';
import type { JobInput, JobSampling } from '@sluice/protocol';
import { GatewayError } from '../errors.js';
import { engineSeed, seedSchema } from './engine-seed.js';

/**
 * Zod schemas of the OpenAI request bodies the gateway accepts: they validate every request and are
 * the source of `GET /openapi.json`. A field the gateway does not know is refused with a 400 naming
 * it (an OpenAI feature Sluice lacks, such as `tools`, must never be dropped without a word); fields
 * that would change the answer in ways the engine cannot honour are refused unless set to their
 * no-op value. `null` means "unset", as the OpenAI API treats it.
 */

const opt = <T extends z.ZodType>(schema: T) => schema.nullish().transform((value) => value ?? undefined);

const textPartSchema = z.strictObject({ type: z.literal('text'), text: z.string() }).meta({ id: 'TextContentPart' });

/**
 * A field of OpenAI's API this server has no use for: accepted when null or absent (OpenAI clients send
 * `null` for unset fields, and an assistant message sent back as it was received carries some), refused
 * otherwise.
 */
const unsupported = (what: string) =>
  opt(z.unknown().refine(() => false, `${what} is not supported by this server.`)).meta({
    description: 'Not supported: only null is accepted.',
  });

export const messageSchema = z
  .strictObject({
    role: z.enum(['system', 'developer', 'user', 'assistant', 'tool']),
    content: z.union([z.string(), z.array(textPartSchema)]).nullish(),
    name: opt(z.string()),
    // What an assistant message of a reply carries (`choices[0].message`), sent back in the next request.
    refusal: opt(z.string()).meta({ description: "An assistant message's refusal as received; not rendered." }),
    tool_calls: opt(z.array(z.unknown()).max(0, 'tool_calls are not supported')).meta({
      description: 'Not supported: only an empty list is accepted.',
    }),
    function_call: unsupported('function_call'),
    audio: unsupported('audio'),
    tool_call_id: opt(z.string()).meta({ description: 'Required on a `tool` message (as OpenAI requires it); not rendered.' }),
  })
  .superRefine((message, ctx) => {
    if (message.role !== 'assistant' && message.tool_calls !== undefined) {
      ctx.addIssue({ code: 'custom', path: ['tool_calls'], message: `is not supported by this server on a ${message.role} message.` });
    }
    if (message.role === 'tool' && message.tool_call_id === undefined) {
      ctx.addIssue({ code: 'custom', path: ['tool_call_id'], message: 'is required on a tool message.' });
    }
    // Only an assistant message may come without content (OpenAI's, with tool calls or a refusal).
    if (message.role !== 'assistant' && (message.content === null || message.content === undefined)) {
      ctx.addIssue({ code: 'custom', path: ['content'], message: `is required on a ${message.role} message.` });
    }
  })
  .meta({ id: 'ChatMessage', description: 'A chat message. Content parts other than text (images, audio) are refused.' });

// Non-empty, as the engine requires (resolve-request.ts): an empty stop sequence would match at once.
const stopString = z.string().min(1, 'must be a non-empty string.');

const stopSchema = opt(z.union([stopString, z.array(stopString).max(16)])).meta({
  description: 'Up to 16 non-empty sequences where generation stops; the stop sequence is not included in the text.',
});

const streamOptionsSchema = z
  .strictObject({
    include_usage: opt(z.boolean()).meta({
      description: 'Send one last chunk with `choices: []` and the usage; other chunks carry `usage: null`.',
    }),
    continuous_usage_stats: opt(z.boolean()).meta({
      description: 'vLLM extension: every chunk carries the usage so far (prompt tokens, completion tokens written up to that chunk).',
    }),
  })
  .meta({ id: 'StreamOptions' });

/** Fields common to both endpoints. */
const commonFields = {
  model: z.string().min(1).meta({ description: 'A model id from `GET /v1/models`.' }),
  stream: opt(z.boolean()).meta({ description: 'Stream the answer as Server-Sent Events (`data: {chunk}` frames, then `data: [DONE]`).' }),
  stream_options: opt(streamOptionsSchema),
  temperature: opt(z.number().min(0).max(2)).meta({ description: '0 = greedy. Default 1.' }),
  top_p: opt(z.number().gt(0).max(1)),
  top_k: opt(z.number().int().min(-1)).meta({ description: 'vLLM extension: sample among the k most likely tokens (0 or -1: off).' }),
  min_p: opt(z.number().min(0).max(1)).meta({ description: 'vLLM extension: drop tokens less likely than min_p × the most likely one.' }),
  seed: opt(seedSchema).meta({
    description:
      'Same seed, same tokens, whatever else shares the batch. An int64: values past 2^53 are taken as JSON numbers read them (rounded to a double).',
  }),
  stop: stopSchema,
  n: opt(z.number().int().min(1).max(16)).meta({ description: "Choices per prompt; they share the prompt's prefill." }),
  presence_penalty: opt(z.number().min(-2).max(2)),
  frequency_penalty: opt(z.number().min(-2).max(2)),
  repetition_penalty: opt(z.number().gt(0).max(2)).meta({ description: 'vLLM extension (1 = off).' }),
  ignore_eos: opt(z.boolean()).meta({ description: 'vLLM extension: keep generating past the end-of-sequence token.' }),
  user: opt(z.string()).meta({ description: 'Accepted for compatibility; logged nowhere.' }),
  max_tokens: opt(z.number().int().min(1)),
  resume_grace_ms: opt(z.number().int().min(0)).meta({
    description:
      "Sluice extension: how long (ms) a streamed request outlives its client's connection. Within it the stream can be resumed " +
      'from any gateway with `GET /v1/{chat/completions|completions}/{id}?stream=true` and `Last-Event-ID`. ' +
      "Capped by the gateway's MAX_RESUME_GRACE_MS; default RESUME_GRACE_MS.",
  }),
  // A key that is no token id is refused as `logit_bias.<key>: Invalid key in record` (zod reports the record's issue).
  logit_bias: opt(z.record(z.string().regex(/^(0|[1-9]\d*)$/), z.number().min(-100).max(100))).meta({
    description:
      'Token id → bias in [-100, 100], added to the logits before penalties and sampling: -100 all but bans a token, 100 all but forces it. ' +
      "Logprobs stay the model's own.",
  }),
  // Accepted no-ops: they do not change the answer.
  service_tier: opt(z.enum(['auto', 'default'])).meta({ description: 'Accepted for compatibility; there is one tier.' }),
  store: opt(z.literal(false, 'store is not supported')).meta({ description: 'Not supported: only false is accepted.' }),
};

export const chatRequestSchema = z
  .strictObject({
    ...commonFields,
    messages: z.array(messageSchema).min(1),
    max_completion_tokens: opt(z.number().int().min(1)).meta({ description: 'Takes precedence over the deprecated `max_tokens`.' }),
    logprobs: opt(z.boolean()),
    top_logprobs: opt(z.number().int().min(0).max(20)).meta({ description: 'Alternatives per position (requires `logprobs: true`).' }),
    tools: opt(z.array(z.unknown()).max(0, 'tools are not supported')).meta({
      description: 'Not supported: only an empty list is accepted.',
    }),
    tool_choice: opt(z.literal('none', 'tool_choice is not supported')).meta({ description: 'Not supported: only "none" is accepted.' }),
    functions: opt(z.array(z.unknown()).max(0, 'functions are not supported')).meta({
      description: 'Not supported: only an empty list is accepted.',
    }),
    response_format: opt(z.strictObject({ type: z.literal('text', 'only response_format {"type":"text"} is supported') })).meta({
      description: 'Not supported beyond `{"type": "text"}`.',
    }),
    parallel_tool_calls: unsupported('parallel_tool_calls'),
    modalities: unsupported('modalities'),
    function_call: unsupported('function_call'),
    metadata: unsupported('metadata'),
    audio: unsupported('audio'),
    prediction: unsupported('prediction'),
    reasoning_effort: unsupported('reasoning_effort'),
    web_search_options: unsupported('web_search_options'),
  })
  .meta({ id: 'CreateChatCompletionRequest' });

const tokenIds = z.array(z.number().int().min(0)).min(1);

/** At most this many prompts in one completions request (each is its own job). */
export const MAX_PROMPTS = 32;

export const completionRequestSchema = z
  .strictObject({
    ...commonFields,
    prompt: z
      .union([z.string(), z.array(z.string()).min(1).max(MAX_PROMPTS), tokenIds, z.array(tokenIds).min(1).max(MAX_PROMPTS)], {
        // Every array branch refuses `[]` alike, which zod reports only as "Invalid input".
        error: (issue) => (Array.isArray(issue.input) && issue.input.length === 0 ? 'must hold at least one prompt.' : undefined),
      })
      .meta({
        description:
          'A prompt (text or token ids) or a batch of prompts. A batch of P prompts with n choices answers with P × n choices; ' +
          'choice `index` = prompt index × n + choice index, as OpenAI does.',
      }),
    logprobs: opt(z.number().int().min(0).max(20)).meta({
      description:
        'Log probability of each sampled token, with the `logprobs` most likely alternatives; `top_logprobs` also holds the sampled token (up to logprobs + 1 entries).',
    }),
    echo: opt(z.boolean()).meta({
      description: 'Put the prompt before the completion text (not with `logprobs`: prompt logprobs are not computed).',
    }),
    suffix: opt(z.string().max(0, 'suffix is not supported')).meta({ description: 'Not supported: only an empty string is accepted.' }),
    best_of: opt(z.literal(1, 'best_of other than 1 is not supported')).meta({ description: 'Not supported: only 1 is accepted.' }),
  })
  .meta({ id: 'CreateCompletionRequest' });

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
  /** `stream_options.continuous_usage_stats`: usage on every chunk. */
  continuousUsage?: boolean;
  /** Completions with a batch of prompts: every prompt (`input` is the first); each becomes its own job. */
  prompts?: JobInput[];
  /** Completions `echo`: the prompt goes before each choice's text. */
  echo?: boolean;
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
  if (issue.code === 'unrecognized_keys') {
    const param = formatPath([...issue.path, issue.keys[0] ?? '']);
    return new GatewayError('invalid_request', { message: `${param}: is not supported by this server.`, param });
  }
  const described = describeIssue(issue, valueAt(body, issue.path));
  const path = [...issue.path, ...described.path];
  const param = formatPath(path);
  const message = valueAt(body, path) === undefined ? 'is required.' : described.message;
  return new GatewayError('invalid_request', { message: param === null ? message : `${param}: ${message}`, param });
}

/**
 * What to say of an issue (zod says only "Invalid input" of a union): inside a union, the branch that
 * got furthest names the field within the value; a union whose every branch refused the value's type
 * says which types it takes. @returns the path within the value, and the message
 */
function describeIssue(issue: z.core.$ZodIssue, value: unknown): { path: PropertyKey[]; message: string } {
  if (issue.code !== 'invalid_union') return { path: [], message: issue.message };
  const firsts = issue.errors.flatMap((branch) => branch.slice(0, 1));
  const deepest = firsts.reduce<z.core.$ZodIssue | undefined>(
    (best, next) => (next.path.length > (best?.path.length ?? 0) ? next : best),
    undefined,
  );
  if (deepest !== undefined) {
    const inner = describeIssue(deepest, valueAt(value, deepest.path));
    return { path: [...deepest.path, ...inner.path], message: inner.message };
  }
  if (firsts.length === 0 || !firsts.every((first) => first.code === 'invalid_type')) return { path: [], message: issue.message };
  const expected = new Set(firsts.map((first) => (first.code === 'invalid_type' ? (TYPE_NAMES[first.expected] ?? first.expected) : '')));
  return { path: [], message: `must be ${[...expected].join(' or ')}, not ${kindOf(value)}.` };
}

const TYPE_NAMES: Partial<Record<string, string>> = {
  string: 'a string',
  number: 'a number',
  int: 'an integer',
  boolean: 'a boolean',
  array: 'an array',
  object: 'an object',
  null: 'null',
};

function kindOf(value: unknown): string {
  if (value === null) return 'null';
  if (Array.isArray(value)) return 'an array';
  return TYPE_NAMES[typeof value] ?? typeof value;
}

export function parseWith<T extends z.ZodType>(schema: T, body: unknown): z.infer<T> {
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
  if (body.seed !== undefined) sampling.seed = engineSeed(body.seed);
  if (body.stop !== undefined) sampling.stop = typeof body.stop === 'string' ? [body.stop] : body.stop;
  if (body.n !== undefined) sampling.n = body.n;
  if (body.presence_penalty !== undefined) sampling.presencePenalty = body.presence_penalty;
  if (body.frequency_penalty !== undefined) sampling.frequencyPenalty = body.frequency_penalty;
  if (body.repetition_penalty !== undefined) sampling.repetitionPenalty = body.repetition_penalty;
  if (body.ignore_eos !== undefined) sampling.ignoreEos = body.ignore_eos;
  const bias = Object.entries(body.logit_bias ?? {});
  if (bias.length > 0) sampling.logitBias = bias.map(([id, value]) => [Number(id), value]);
  return sampling;
}

function streamFlags(body: {
  stream?: boolean | undefined;
  stream_options?: { include_usage?: boolean | undefined; continuous_usage_stats?: boolean | undefined } | undefined;
}) {
  const stream = body.stream ?? false;
  if (!stream && body.stream_options !== undefined) {
    throw new GatewayError('invalid_request', {
      message: 'stream_options: only allowed when stream is true.',
      param: 'stream_options',
    });
  }
  const flags = { stream, includeUsage: body.stream_options?.include_usage ?? false };
  return body.stream_options?.continuous_usage_stats === true ? { ...flags, continuousUsage: true } : flags;
}

function flattenContent(content: string | Array<{ text: string }> | null | undefined): string {
  if (content === null || content === undefined) return '';
  return typeof content === 'string' ? content : content.map((part) => part.text).join('');
}

/** A validated message as the chat template renders it. */
export function toJobMessage(m: z.infer<typeof messageSchema>): { role: string; content: string; name?: string } {
  // OpenAI's `developer` is its new name for `system`: model chat templates know only `system`.
  const message: { role: string; content: string; name?: string } = {
    role: m.role === 'developer' ? 'system' : m.role,
    content: flattenContent(m.content),
  };
  if (m.name !== undefined) message.name = m.name;
  return message;
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
  const messages = req.messages.map(toJobMessage);
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
  const prompts = promptInputs(req.prompt);
  const input = prompts[0]!;
  const echo = req.echo === true;
  if (echo && req.logprobs !== undefined) {
    throw new GatewayError('invalid_request', {
      message: "echo: not supported together with logprobs (the prompt's logprobs are not computed).",
      param: 'echo',
    });
  }
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
    ...(prompts.length > 1 ? { prompts } : {}),
    ...(echo ? { echo } : {}),
  };
}

/** The prompts of a completions request: one string, one token-id list, or a batch of either. */
function promptInputs(prompt: string | string[] | number[] | number[][]): JobInput[] {
  if (typeof prompt === 'string') return [{ kind: 'text', prompt }];
  if (prompt.every((p): p is number => typeof p === 'number')) return [{ kind: 'tokens', promptTokenIds: prompt }];
  return (prompt as Array<string | number[]>).map((p) =>
    typeof p === 'string' ? { kind: 'text', prompt: p } : { kind: 'tokens', promptTokenIds: p },
  );
}
