import { IDEMPOTENCY_KEY_PATTERN } from '../idempotency-store.js';
import { z } from 'zod';
import { createDocument, type ZodOpenApiOperationObject, type ZodOpenApiResponsesObject } from 'zod-openapi';
import { errorCodeTable, type GatewayErrorCode } from '../errors.js';
import { chatRequestSchema, completionRequestSchema } from '../openai/request-schemas.js';
import {
  cancelReplySchema,
  chatCompletionChunkSchema,
  chatCompletionSchema,
  completionChunkSchema,
  completionSchema,
  errorResponseSchema,
  healthSchema,
  modelListSchema,
  modelSchema,
  readySchema,
  versionSchema,
} from '../openai/response-schemas.js';
import {
  detokenizeRequestSchema,
  detokenizeResponseSchema,
  tokenizeRequestSchema,
  tokenizeResponseSchema,
} from '../openai/tokenize-schemas.js';

/**
 * The OpenAPI 3.1 document of the gateway (`GET /openapi.json`), built from the zod schemas that
 * validate the requests (`request-schemas.ts`) and describe the replies (`response-schemas.ts`), and
 * from the error table (`errors.ts`): one source of truth, so the document cannot drift from the code
 * unnoticed (`test/openapi-contract.test.ts` checks real replies against it).
 *
 * SSE streams are `text/event-stream` whose events' `data:` is a JSON chunk: OpenAPI 3.1 has no way to
 * type the events, so the media type carries `x-sse-data`, a schema of one event's data (the chunk,
 * or the error frame), referring to the component schemas.
 */

const codes = Object.keys(errorCodeTable) as [GatewayErrorCode, ...GatewayErrorCode[]];
const errorSchema = errorResponseSchema(codes);
const ref = (id: string) => ({ $ref: `#/components/schemas/${id}` });

/** Error replies by status, each listing the codes it carries. */
function errors(...which: GatewayErrorCode[]): ZodOpenApiResponsesObject {
  const byStatus = new Map<number, GatewayErrorCode[]>();
  for (const code of which) {
    const status = errorCodeTable[code].status;
    byStatus.set(status, [...(byStatus.get(status) ?? []), code]);
  }
  const out: ZodOpenApiResponsesObject = {};
  for (const [status, list] of [...byStatus].sort(([a], [b]) => a - b)) {
    const retry = list.some((code) => errorCodeTable[code].retry === true);
    out[`${status}` as `4${string}`] = {
      description: list.map((code) => `\`${code}\`: ${errorCodeTable[code].message}`).join(' '),
      ...(retry ? { headers: z.object({ 'Retry-After': z.string().meta({ description: 'Seconds to wait before retrying.' }) }) } : {}),
      ...(status === 405 ? { headers: z.object({ Allow: z.string() }) } : {}),
      content: { 'application/json': { schema: errorSchema } },
    };
  }
  return out;
}

/** What access control answers (when it is on: `Authorization: Bearer <key>`), on every `/v1` route and tokenization. */
const ACCESS: GatewayErrorCode[] = ['invalid_api_key', 'rate_limit_exceeded'];

const REFUSALS: GatewayErrorCode[] = [
  ...ACCESS,
  'model_not_allowed',
  'unsupported_media_type',
  'invalid_json',
  'invalid_request',
  'context_length_exceeded',
  'model_not_found',
  'request_too_large',
  'queue_full',
  'tokens_over_key_limit',
  'idempotency_key_reused',
  'idempotency_conflict',
  'no_workers',
  'store_unavailable',
  'shutting_down',
  'queue_timeout',
  'idle_timeout',
  'deadline_exceeded',
  'worker_lost',
  'worker_shutdown',
  'internal',
];

const requestIdHeader = z.object({
  'X-Request-Id': z
    .string()
    .meta({ description: "The request's id: the client's `X-Request-Id` when it is a sane id, else the gateway's own." }),
});

/** A stream's headers: what a client cut off before the first chunk resumes or cancels it by. */
const streamIdHeader = {
  'X-Stream-Id': z.string().meta({
    description:
      "Streams only: the `id` of the stream's chunks (`chatcmpl-…` / `cmpl-…`), the `{id}` of the resume and cancel routes, " +
      'sent before the first chunk (a completions stream has none until its first token).',
  }),
};

const generateHeaders = requestIdHeader.extend({
  ...streamIdHeader,
  'Server-Timing': z.string().meta({
    description:
      "Where the request's time went before the answer, ms: `admit` (body read, validated, tokenized), `queue` (until a " +
      'worker accepted it), and on a complete reply `generate` (until the answer was whole). A stream sends its headers ' +
      'before its answer: `admit` only, or `admit` and `queue` when a worker accepted it within HEADERS_WAIT_MS.',
  }),
});

function sse(chunk: string, what: string) {
  return {
    schema: {
      type: 'string' as const,
      description:
        `Server-Sent Events. Each event: \`id: <cursor>\` (the resume cursor), then \`data: <${chunk} JSON>\`; ` +
        `\`: ping\` comments keep the connection alive; the stream ends with \`data: [DONE]\`. ${what} ` +
        'After the 200, an error is one `data: <ErrorResponse JSON>` event, then `data: [DONE]`.',
    },
    'x-sse-data': { oneOf: [ref(chunk), ref('ErrorResponse')] },
  };
}

function generation(kind: 'chat' | 'completion'): ZodOpenApiOperationObject {
  const chat = kind === 'chat';
  return {
    operationId: chat ? 'createChatCompletion' : 'createCompletion',
    tags: ['Generation'],
    summary: chat ? 'Create a chat completion' : 'Create a completion',
    description: chat
      ? 'OpenAI chat completions. `stream: true` answers with SSE chunks; fields Sluice does not support are refused with a 400 naming them.'
      : 'OpenAI (legacy) completions, with prompt batches, `echo` and `logprobs`. Fields Sluice does not support are refused with a 400 naming them.',
    requestParams: {
      header: z.object({
        'Idempotency-Key': z
          .string()
          .regex(IDEMPOTENCY_KEY_PATTERN)
          .optional()
          .meta({
            description:
              'Makes a retry safe: a POST that comes again with the same key (under the same API key) and the same body is answered ' +
              'with the request the first one admitted, from its token log (as a resume from the start), neither generated nor ' +
              "charged again; with another body or route it is refused (422). Kept for the request's retention. The deployment's " +
              'nginx sends its `$request_id` when the client sends none, so its own retries to another gateway are safe. Not for ' +
              'a batch of prompts.',
          }),
      }),
    },
    requestBody: { required: true, content: { 'application/json': { schema: chat ? chatRequestSchema : completionRequestSchema } } },
    responses: {
      '200': {
        description: chat
          ? 'The completion, or its stream of chunks (`stream: true`).'
          : 'The completion, or its stream of chunks (`stream: true`).',
        headers: generateHeaders,
        content: {
          'application/json': { schema: chat ? chatCompletionSchema : completionSchema },
          'text/event-stream': sse(chat ? 'ChatCompletionChunk' : 'CompletionChunk', 'A stream outlives its client for `resume_grace_ms`.'),
        },
      },
      ...errors(...REFUSALS),
    },
  };
}

const idParam = z.object({
  id: z.string().meta({ description: "The `id` of the stream's chunks (`chatcmpl-…` / `cmpl-…`)." }),
});

function resume(kind: 'chat' | 'completion'): ZodOpenApiOperationObject {
  const chat = kind === 'chat';
  return {
    operationId: chat ? 'resumeChatCompletion' : 'resumeCompletion',
    tags: ['Durable streams'],
    summary: chat ? 'Resume a chat completion stream' : 'Resume a completion stream',
    description:
      'Sluice extension: the rest of a stream after a cursor, from any gateway, while the request runs (within its `resume_grace_ms` ' +
      'once its client left) and for the retention after it ended. A browser `EventSource` sends `Last-Event-ID` by itself.',
    requestParams: {
      path: idParam,
      query: z.object({
        stream: z.literal('true').meta({ description: 'Only streams can be resumed.' }),
        starting_after: z
          .string()
          .regex(/^-?\d+$/)
          .optional()
          .meta({ description: 'The cursor (`id:`) of the last event received; -1 or absent: from the start.' }),
      }),
      header: z.object({
        'Last-Event-ID': z
          .string()
          .regex(/^-?\d+$/)
          .optional()
          .meta({ description: 'The cursor of the last event received (takes precedence over `starting_after`).' }),
      }),
    },
    responses: {
      '200': {
        description: 'The rest of the stream, in the same chunk format.',
        headers: requestIdHeader.extend(streamIdHeader),
        content: { 'text/event-stream': sse(chat ? 'ChatCompletionChunk' : 'CompletionChunk', '') },
      },
      ...errors(...ACCESS, 'invalid_request', 'not_found', 'no_workers', 'store_unavailable', 'shutting_down'),
    },
  };
}

function cancel(kind: 'chat' | 'completion'): ZodOpenApiOperationObject {
  const chat = kind === 'chat';
  return {
    operationId: chat ? 'cancelChatCompletion' : 'cancelCompletion',
    tags: ['Durable streams'],
    summary: chat ? 'Cancel a chat completion' : 'Cancel a completion',
    description: 'Sluice extension: stops the request from any gateway; its stream, if open, ends with `finish_reason: "abort"`.',
    requestParams: { path: idParam },
    responses: {
      '200': { description: 'The cancel was sent to the worker.', content: { 'application/json': { schema: cancelReplySchema } } },
      ...errors(...ACCESS, 'not_found'),
    },
  };
}

const json = (schema: z.ZodType, description: string) => ({ description, content: { 'application/json': { schema } } });

/** Builds the document (a plain JSON object); `version` is the gateway's. */
export function createOpenApiDocument(version: string): object {
  return createDocument({
    openapi: '3.1.0',
    info: {
      title: 'Sluice',
      version,
      description:
        'An OpenAI-compatible LLM streaming gateway. Streams are Server-Sent Events; every event carries an `id:` cursor that ' +
        '`GET /v1/{chat/completions|completions}/{id}?stream=true` resumes from, on any gateway. Sluice extensions (vLLM-style ' +
        'sampling fields, `resume_grace_ms`, `continuous_usage_stats`, tokenize/detokenize) are marked as such.',
      license: { name: 'See the repository' },
    },
    servers: [{ url: '/' }],
    security: [{ bearerAuth: [] }, {}],
    tags: [{ name: 'Generation' }, { name: 'Durable streams' }, { name: 'Models' }, { name: 'Tokenization' }, { name: 'Operations' }],
    paths: {
      '/v1/chat/completions': { post: generation('chat') },
      '/v1/completions': { post: generation('completion') },
      '/v1/chat/completions/{id}': { get: resume('chat') },
      '/v1/completions/{id}': { get: resume('completion') },
      '/v1/chat/completions/{id}/cancel': { post: cancel('chat') },
      '/v1/completions/{id}/cancel': { post: cancel('completion') },
      '/v1/models': {
        get: {
          operationId: 'listModels',
          tags: ['Models'],
          summary: 'The models live workers serve',
          responses: { '200': json(modelListSchema, 'The models.'), ...errors(...ACCESS) },
        },
      },
      '/v1/models/{id}': {
        get: {
          operationId: 'retrieveModel',
          tags: ['Models'],
          summary: 'One model',
          requestParams: { path: z.object({ id: z.string().meta({ description: 'A model id; may contain `/`.' }) }) },
          responses: { '200': json(modelSchema, 'The model.'), ...errors(...ACCESS, 'model_not_found') },
        },
      },
      '/tokenize': {
        post: {
          operationId: 'tokenize',
          tags: ['Tokenization'],
          summary: 'Text or messages to token ids',
          description:
            "vLLM's shape. Messages are rendered with the model chat template (with the assistant turn's opening). " +
            'A prompt of more than `max_model_len` tokens is refused (`context_length_exceeded`), as vLLM refuses it.',
          requestBody: { required: true, content: { 'application/json': { schema: tokenizeRequestSchema } } },
          responses: {
            '200': json(tokenizeResponseSchema, 'The token ids.'),
            ...errors(
              ...ACCESS,
              'model_not_allowed',
              'unsupported_media_type',
              'invalid_json',
              'invalid_request',
              'context_length_exceeded',
              'model_not_found',
              'request_too_large',
              'no_workers',
              'store_unavailable',
            ),
          },
        },
      },
      '/detokenize': {
        post: {
          operationId: 'detokenize',
          tags: ['Tokenization'],
          summary: 'Token ids to text',
          requestBody: { required: true, content: { 'application/json': { schema: detokenizeRequestSchema } } },
          responses: {
            '200': json(detokenizeResponseSchema, 'The text.'),
            ...errors(
              ...ACCESS,
              'model_not_allowed',
              'unsupported_media_type',
              'invalid_json',
              'invalid_request',
              'model_not_found',
              'request_too_large',
              'no_workers',
              'store_unavailable',
            ),
          },
        },
      },
      '/health': {
        get: {
          operationId: 'health',
          tags: ['Operations'],
          summary: 'Liveness (alias of /healthz)',
          responses: { '200': json(healthSchema, 'Alive.') },
        },
      },
      '/healthz': {
        get: { operationId: 'healthz', tags: ['Operations'], summary: 'Liveness', responses: { '200': json(healthSchema, 'Alive.') } },
      },
      '/readyz': {
        get: {
          operationId: 'readyz',
          tags: ['Operations'],
          summary: 'Readiness: Redis answers and a worker is live',
          responses: { '200': json(readySchema, 'Ready.'), '503': json(readySchema, 'Not ready, or draining.') },
        },
      },
      '/version': {
        get: {
          operationId: 'version',
          tags: ['Operations'],
          summary: 'The gateway release',
          responses: { '200': json(versionSchema, 'The version.') },
        },
      },
      '/metrics': {
        get: {
          operationId: 'metrics',
          tags: ['Operations'],
          summary: 'Prometheus metrics (text format 0.0.4)',
          responses: { '200': { description: 'The metrics.', content: { 'text/plain': { schema: { type: 'string' } } } } },
        },
      },
    },
    components: {
      schemas: {
        ChatCompletionChunk: chatCompletionChunkSchema,
        CompletionChunk: completionChunkSchema,
        ErrorResponse: errorSchema,
      },
      securitySchemes: {
        bearerAuth: {
          type: 'http',
          scheme: 'bearer',
          description: 'An API key, when the gateway has access control on (`Authorization: Bearer <key>`); optional otherwise.',
        },
      },
    },
  });
}
