import { EngineError } from './engine-error.js';
import type { GenerateRequest, SamplingParams } from './types.js';

/** Sampling parameters with every default filled in. */
export type ResolvedSampling = Required<Omit<SamplingParams, 'seed'>> & { seed: number | undefined };

/** A validated request as it crosses to the engine thread. */
export interface ResolvedRequest {
  id: string;
  promptTokenIds: number[];
  sampling: ResolvedSampling;
  /** See {@link GenerateRequest.continuation}. */
  continuation?: { choiceIndex: number; generatedTokenIds: number[] };
}

/** What a request is checked against. */
export interface RequestLimits {
  vocabSize: number;
  maxContextLength: number;
  maxBatchSize: number;
  maxCachedTokens: number;
}

/** The most alternatives per position a request may ask for (OpenAI's limit). */
export const MAX_TOP_LOGPROBS = 20;

/** The largest logit bias either way (OpenAI's range). */
export const MAX_LOGIT_BIAS = 100;

/**
 * Checks a request and fills in defaults. Throws `invalid_request` naming the field, or
 * `context_length_exceeded` with the numbers when the request could never be scheduled.
 */
export function resolveRequest(request: GenerateRequest, limits: RequestLimits): ResolvedRequest {
  const fail = (field: string, rule: string): never => {
    throw new EngineError('invalid_request', `Request ${request.id}: ${field} ${rule}.`);
  };
  if (!Array.isArray(request.promptTokenIds) || request.promptTokenIds.length === 0) {
    fail('promptTokenIds', 'must be a non-empty array of token ids');
  }
  for (const id of request.promptTokenIds) {
    if (!Number.isInteger(id) || id < 0 || id >= limits.vocabSize) {
      fail('promptTokenIds', `must hold integers in [0, ${limits.vocabSize}), got ${String(id)}`);
    }
  }
  const s = request.sampling;
  const sampling: ResolvedSampling = {
    maxTokens: s.maxTokens ?? 16,
    temperature: s.temperature ?? 1,
    topP: s.topP ?? 1,
    topK: s.topK ?? 0,
    minP: s.minP ?? 0,
    presencePenalty: s.presencePenalty ?? 0,
    frequencyPenalty: s.frequencyPenalty ?? 0,
    repetitionPenalty: s.repetitionPenalty ?? 1,
    seed: s.seed,
    logprobs: (s.logprobs ?? false) || (s.topLogprobs ?? 0) > 0,
    topLogprobs: s.topLogprobs ?? 0,
    stop: s.stop ?? [],
    stopTokenIds: s.stopTokenIds ?? [],
    ignoreEos: s.ignoreEos ?? false,
    logitBias: s.logitBias ?? [],
    n: s.n ?? 1,
  };
  if (!Number.isInteger(sampling.maxTokens) || sampling.maxTokens < 1) fail('maxTokens', 'must be an integer ≥ 1');
  if (!isFiniteAtLeast(sampling.temperature, 0)) fail('temperature', 'must be a finite number ≥ 0');
  if (!(Number.isFinite(sampling.topP) && sampling.topP > 0 && sampling.topP <= 1)) fail('topP', 'must be in (0, 1]');
  if (!Number.isInteger(sampling.topK) || sampling.topK < -1) fail('topK', 'must be an integer ≥ -1 (0 or -1 disables it)');
  if (!(Number.isFinite(sampling.minP) && sampling.minP >= 0 && sampling.minP <= 1)) fail('minP', 'must be in [0, 1]');
  for (const field of ['presencePenalty', 'frequencyPenalty'] as const) {
    const value = sampling[field];
    if (!(Number.isFinite(value) && value >= -2 && value <= 2)) fail(field, 'must be in [-2, 2]');
  }
  if (!(Number.isFinite(sampling.repetitionPenalty) && sampling.repetitionPenalty > 0)) {
    fail('repetitionPenalty', 'must be a finite number > 0');
  }
  if (sampling.seed !== undefined && !Number.isSafeInteger(sampling.seed)) fail('seed', 'must be a safe integer');
  if (!Number.isInteger(sampling.topLogprobs) || sampling.topLogprobs < 0 || sampling.topLogprobs > MAX_TOP_LOGPROBS) {
    fail('topLogprobs', `must be an integer in [0, ${MAX_TOP_LOGPROBS}]`);
  }
  if (!Array.isArray(sampling.stop) || sampling.stop.some((stop) => typeof stop !== 'string' || stop.length === 0)) {
    fail('stop', 'must be an array of non-empty strings');
  }
  if (
    !Array.isArray(sampling.stopTokenIds) ||
    sampling.stopTokenIds.some((id) => !Number.isInteger(id) || id < 0 || id >= limits.vocabSize)
  ) {
    fail('stopTokenIds', `must hold integers in [0, ${limits.vocabSize})`);
  }
  if (
    !Array.isArray(sampling.logitBias) ||
    sampling.logitBias.some(
      (pair) =>
        !Array.isArray(pair) ||
        !Number.isInteger(pair[0]) ||
        pair[0] < 0 ||
        pair[0] >= limits.vocabSize ||
        !(Number.isFinite(pair[1]) && pair[1] >= -MAX_LOGIT_BIAS && pair[1] <= MAX_LOGIT_BIAS),
    )
  ) {
    fail(
      'logitBias',
      `must hold [tokenId, bias] pairs, token ids in [0, ${limits.vocabSize}), biases in [-${MAX_LOGIT_BIAS}, ${MAX_LOGIT_BIAS}]`,
    );
  }
  if (!Number.isInteger(sampling.n) || sampling.n < 1 || sampling.n > limits.maxBatchSize) {
    fail('n', `must be an integer in [1, ${limits.maxBatchSize}] (the engine's max batch size)`);
  }

  const continuation = request.continuation;
  if (continuation !== undefined) {
    if (sampling.n !== 1) fail('n', 'must be 1 in a continuation');
    if (!Number.isInteger(continuation.choiceIndex) || continuation.choiceIndex < 0)
      fail('continuation.choiceIndex', 'must be an integer ≥ 0');
    const generated = continuation.generatedTokenIds;
    if (!Array.isArray(generated) || generated.some((id) => !Number.isInteger(id) || id < 0 || id >= limits.vocabSize)) {
      fail('continuation.generatedTokenIds', `must hold integers in [0, ${limits.vocabSize})`);
    }
    if (generated.length >= sampling.maxTokens) fail('continuation.generatedTokenIds', 'must be fewer than maxTokens');
  }

  const promptTokens = request.promptTokenIds.length;
  const total = promptTokens + sampling.maxTokens;
  if (total > limits.maxContextLength) {
    throw new EngineError(
      'context_length_exceeded',
      `Request ${request.id}: prompt (${promptTokens} tokens) + maxTokens (${sampling.maxTokens}) = ${total} tokens ` +
        `exceeds the model's context length of ${limits.maxContextLength} tokens.`,
    );
  }
  if (total * sampling.n > limits.maxCachedTokens) {
    throw new EngineError(
      'context_length_exceeded',
      `Request ${request.id}: n (${sampling.n}) × (prompt ${promptTokens} + maxTokens ${sampling.maxTokens}) = ` +
        `${total * sampling.n} tokens can never fit the engine's KV cache of ${limits.maxCachedTokens} tokens.`,
    );
  }
  const resolved: ResolvedRequest = { id: request.id, promptTokenIds: [...request.promptTokenIds], sampling };
  if (continuation !== undefined) {
    resolved.continuation = { choiceIndex: continuation.choiceIndex, generatedTokenIds: [...continuation.generatedTokenIds] };
  }
  return resolved;
}

function isFiniteAtLeast(value: number, min: number): boolean {
  return Number.isFinite(value) && value >= min;
}
