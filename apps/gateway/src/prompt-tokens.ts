import { resolveMaxTokens } from '@sluice/protocol';
import { GatewayError } from './errors.js';
import type { ParsedRequest } from './openai/request-schemas.js';
import type { ModelTokenizer } from './tokenizer-cache.js';
import type { ServedModel } from './worker-registry.js';

/** A prompt that fits the model, and the completion tokens it may have. */
export interface CheckedPrompt {
  ids: number[];
  /**
   * The client's `max_tokens`, or its default resolved here (to the context left, within the smallest
   * KV cache of the model's workers): the job carries it, so the limit does not depend on which
   * worker runs the request or continues it.
   */
  maxTokens: number;
}

/**
 * The prompt's token ids, checked against the model as the engine would check them: every refusal
 * that depends only on the request is an HTTP 4xx here, before the 200, whatever the load (a worker
 * that is busy or frozen cannot turn it into a late SSE error frame).
 * @param promptParam the client's field of this prompt (`prompt[k]` for prompt k of a batch)
 * @throws GatewayError `invalid_request` or `context_length_exceeded`, naming the client's field
 */
export function checkPrompt(
  request: ParsedRequest,
  tokenizer: ModelTokenizer,
  model: ServedModel,
  promptParam: string = request.endpoint === 'chat' ? 'messages' : 'prompt',
): CheckedPrompt {
  const input = request.input;
  const maxContext = Math.min(tokenizer.maxContextLength, model.maxContextLength);
  // A prompt whose byte length alone proves it cannot fit is refused unencoded: encoding megabytes
  // would hold the gateway's thread (every other stream) for seconds.
  const encoded =
    input.kind === 'chat'
      ? tokenizer.encodeChat(
          input.messages.map((m) => (m.name === undefined ? { role: m.role, content: m.content } : { ...m, name: m.name })),
          maxContext,
        )
      : input.kind === 'text'
        ? tokenizer.encodeText(input.prompt, maxContext)
        : input.promptTokenIds;
  if (!Array.isArray(encoded)) {
    throw tooLong(
      `This model's maximum context length is ${maxContext} tokens. However, your prompt is at least ${encoded.atLeast} tokens long.`,
      promptParam,
    );
  }
  const ids = encoded;
  if (ids.length === 0) throw new GatewayError('invalid_request', { message: `${promptParam}: must not be empty.`, param: promptParam });
  if (input.kind === 'tokens') {
    const bad = ids.find((id) => id >= tokenizer.vocabSize);
    if (bad !== undefined) {
      throw new GatewayError('invalid_request', {
        message: `${promptParam}: token ids must be in [0, ${tokenizer.vocabSize}), got ${bad}.`,
        param: promptParam,
      });
    }
  }
  const badBias = request.sampling.logitBias?.find(([id]) => id >= tokenizer.vocabSize);
  if (badBias !== undefined) {
    throw new GatewayError('invalid_request', {
      message: `logit_bias: token ids must be in [0, ${tokenizer.vocabSize}), got ${badBias[0]}.`,
      param: 'logit_bias',
    });
  }
  if (ids.length >= maxContext) {
    throw tooLong(
      `This model's maximum context length is ${maxContext} tokens. However, your prompt is ${ids.length} tokens long.`,
      promptParam,
    );
  }
  const maxTokens = resolveMaxTokens(request.sampling.maxTokens, request.defaultMaxTokens, {
    promptTokens: ids.length,
    maxContextLength: maxContext,
    maxCachedTokens: model.maxCachedTokens,
    n: request.n,
  });
  if (ids.length + maxTokens > maxContext) {
    throw tooLong(
      `This model's maximum context length is ${maxContext} tokens. However, you requested ${ids.length + maxTokens} tokens ` +
        `(${ids.length} in the prompt, ${maxTokens} for the completion).`,
      request.maxTokensParam,
    );
  }
  if (model.maxBatchSize !== undefined && request.n > model.maxBatchSize) {
    throw new GatewayError('invalid_request', { message: `n: must be at most ${model.maxBatchSize} for this model.`, param: 'n' });
  }
  // The n choices share the workers' KV cache: all of them must fit it at once.
  const cache = model.maxCachedTokens;
  if (cache !== undefined && (maxTokens < 1 || request.n * (ids.length + maxTokens) > cache)) {
    throw tooLong(
      `This model's KV cache holds ${cache} tokens for all the choices of a request. However, n (${request.n}) × ` +
        `(${ids.length} in the prompt + ${Math.max(1, maxTokens)} for the completion) = ${request.n * (ids.length + Math.max(1, maxTokens))} tokens.` +
        (request.sampling.maxTokens === undefined ? ' Lower n.' : ` Lower ${request.maxTokensParam} or n.`),
      request.sampling.maxTokens === undefined ? 'n' : request.maxTokensParam,
    );
  }
  return { ids, maxTokens };
}

function tooLong(message: string, param: string): GatewayError {
  return new GatewayError('context_length_exceeded', { message, param });
}
