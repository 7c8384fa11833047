import { z } from 'zod';

/**
 * Zod schemas of what the gateway answers. The replies themselves are written from templates
 * (`response-format.ts`, the hot path); these schemas document them in `GET /openapi.json`, and the
 * contract test (`test/openapi-contract.test.ts`) checks every real reply against that document.
 */

const finishReasonSchema = z
  .enum(['stop', 'length', 'abort'])
  .meta({ id: 'FinishReason', description: '`abort`: the request was cancelled (`POST .../{id}/cancel`), as vLLM names it.' });

export const usageSchema = z.object({ prompt_tokens: z.int(), completion_tokens: z.int(), total_tokens: z.int() }).meta({ id: 'Usage' });

const bytesSchema = z
  .array(z.int().min(0).max(255))
  .nullable()
  .meta({ description: "The token's UTF-8 bytes; a token may hold part of a character." });

const chatTokenLogprobSchema = z
  .object({
    token: z.string(),
    logprob: z.number(),
    bytes: bytesSchema,
    top_logprobs: z.array(z.object({ token: z.string(), logprob: z.number(), bytes: bytesSchema })),
  })
  .meta({ id: 'ChatTokenLogprob' });

const chatLogprobsSchema = z
  .object({ content: z.array(chatTokenLogprobSchema) })
  .nullable()
  .meta({ id: 'ChatLogprobs' });

const completionLogprobsSchema = z
  .object({
    tokens: z.array(z.string()),
    token_logprobs: z.array(z.number()),
    top_logprobs: z.array(z.record(z.string(), z.number())).meta({
      description: 'Per position: the most likely tokens and the sampled one, token → logprob (up to logprobs + 1 entries).',
    }),
    text_offset: z.array(z.int()),
  })
  .nullable()
  .meta({ id: 'CompletionLogprobs' });

const fingerprint = z.string().meta({ description: 'Changes when the gateway release or the model changes.' });

const base = {
  id: z.string().meta({ description: '`chatcmpl-<id>` / `cmpl-<id>`: the `{id}` of the resume and cancel routes.' }),
  created: z.int(),
  model: z.string(),
  system_fingerprint: fingerprint,
};

export const chatCompletionSchema = z
  .object({
    ...base,
    object: z.literal('chat.completion'),
    choices: z.array(
      z.object({
        index: z.int(),
        message: z.object({ role: z.literal('assistant'), content: z.string(), refusal: z.null() }),
        logprobs: chatLogprobsSchema,
        finish_reason: finishReasonSchema,
      }),
    ),
    usage: usageSchema,
  })
  .meta({ id: 'ChatCompletion' });

export const chatCompletionChunkSchema = z
  .object({
    ...base,
    object: z.literal('chat.completion.chunk'),
    choices: z.array(
      z.object({
        index: z.int(),
        delta: z.object({ role: z.literal('assistant').optional(), content: z.string().optional() }),
        logprobs: chatLogprobsSchema,
        finish_reason: finishReasonSchema.nullable(),
      }),
    ),
    usage: usageSchema
      .nullable()
      .optional()
      .meta({
        description:
          'With `stream_options.include_usage`: `null` on every chunk, then one last chunk with `choices: []` and the usage. ' +
          'With `continuous_usage_stats`: the usage so far on every chunk.',
      }),
  })
  .meta({
    id: 'ChatCompletionChunk',
    description:
      'One SSE event of a streamed chat completion: `id: <cursor>` then `data: <this JSON>`. The first chunk of each choice carries ' +
      '`delta.role`; the stream ends with `data: [DONE]`.',
  });

const completionChoice = (text: z.ZodString, finish: z.ZodType) =>
  z.object({ index: z.int(), text, logprobs: completionLogprobsSchema, finish_reason: finish });

export const completionSchema = z
  .object({
    ...base,
    object: z.literal('text_completion'),
    choices: z.array(completionChoice(z.string(), finishReasonSchema)),
    usage: usageSchema,
  })
  .meta({ id: 'Completion' });

export const completionChunkSchema = z
  .object({
    ...base,
    object: z.literal('text_completion'),
    choices: z.array(completionChoice(z.string(), finishReasonSchema.nullable())),
    usage: usageSchema.nullable().optional(),
  })
  .meta({ id: 'CompletionChunk', description: 'One SSE event of a streamed completion; the stream ends with `data: [DONE]`.' });

export const errorResponseSchema = (codes: readonly [string, ...string[]]) =>
  z
    .object({
      error: z.object({
        message: z.string(),
        type: z.string(),
        param: z.string().nullable().meta({ description: 'The request field at fault.' }),
        code: z.enum(codes),
      }),
    })
    .meta({
      id: 'ErrorResponse',
      description:
        'An error: the body of any 4xx/5xx reply, and, once a stream sent its 200, one SSE event `data: <this JSON>` followed by `data: [DONE]`.',
    });

export const cancelReplySchema = z
  .object({ id: z.string(), object: z.enum(['chat.completion', 'text_completion']), cancelled: z.literal(true) })
  .meta({ id: 'CancelReply' });

export const modelSchema = z
  .object({
    id: z.string(),
    object: z.literal('model'),
    created: z.int(),
    owned_by: z.string(),
    max_model_len: z.int().meta({ description: 'vLLM extension: prompt + completion tokens the model takes.' }),
  })
  .meta({ id: 'Model' });

export const modelListSchema = z.object({ object: z.literal('list'), data: z.array(modelSchema) }).meta({ id: 'ModelList' });

export const healthSchema = z.object({ status: z.literal('ok') }).meta({ id: 'Health' });
export const readySchema = z
  .object({ status: z.enum(['ready', 'not_ready', 'draining']), redis: z.boolean().optional(), workers: z.int().optional() })
  .meta({ id: 'Readiness' });
export const versionSchema = z.object({ version: z.string() }).meta({ id: 'Version' });
