import { describe, expect, it } from 'vitest';
import { EngineError } from '../src/engine-error.js';
import { resolveRequest } from '../src/resolve-request.js';
import type { SamplingParams } from '../src/types.js';

const limits = { vocabSize: 100, maxContextLength: 64, maxBatchSize: 8, maxCachedTokens: 256 };

function resolve(sampling: SamplingParams, promptTokenIds = [1, 2, 3]) {
  return resolveRequest({ id: 'r1', promptTokenIds, sampling }, limits);
}

function errorOf(run: () => unknown): EngineError {
  try {
    run();
  } catch (error) {
    if (error instanceof EngineError) return error;
    throw error;
  }
  throw new Error('expected an EngineError');
}

describe('resolveRequest', () => {
  it('fills in OpenAI defaults', () => {
    expect(resolve({}).sampling).toMatchObject({ maxTokens: 16, temperature: 1, topP: 1, topK: 0, n: 1, logprobs: false });
  });

  it('rejects a prompt plus max_tokens beyond the context length, naming the numbers', () => {
    const error = errorOf(() => resolve({ maxTokens: 62 }));
    expect(error.code).toBe('context_length_exceeded');
    expect(error.message).toContain('prompt (3 tokens) + maxTokens (62) = 65');
    expect(error.message).toContain('context length of 64');
  });

  it('rejects a request whose n copies could never fit the KV cache', () => {
    const error = errorOf(() => resolve({ maxTokens: 61, n: 5 }));
    expect(error.code).toBe('context_length_exceeded');
    expect(error.message).toContain('256');
  });

  it.each<[SamplingParams, string]>([
    [{ n: 0 }, 'n'],
    [{ n: 9 }, 'n'],
    [{ topP: 0 }, 'topP'],
    [{ topP: 1.5 }, 'topP'],
    [{ topLogprobs: 21 }, 'topLogprobs'],
    [{ temperature: -1 }, 'temperature'],
    [{ maxTokens: 0 }, 'maxTokens'],
    [{ topK: -2 }, 'topK'],
    [{ minP: 2 }, 'minP'],
    [{ presencePenalty: 3 }, 'presencePenalty'],
    [{ repetitionPenalty: 0 }, 'repetitionPenalty'],
    [{ stop: [''] }, 'stop'],
    [{ stopTokenIds: [100] }, 'stopTokenIds'],
    [{ seed: 1.5 }, 'seed'],
    [{ logitBias: [[100, 1]] }, 'logitBias'],
    [{ logitBias: [[1, 101]] }, 'logitBias'],
    [{ logitBias: [[1, Number.NaN]] }, 'logitBias'],
    [{ logitBias: [[1.5, 1]] }, 'logitBias'],
  ])('rejects %j as invalid_request naming %s', (sampling, field) => {
    const error = errorOf(() => resolve(sampling));
    expect(error.code).toBe('invalid_request');
    expect(error.message).toContain(field);
  });

  it('rejects an empty prompt and out-of-vocabulary ids', () => {
    expect(errorOf(() => resolve({}, [])).message).toContain('promptTokenIds');
    expect(errorOf(() => resolve({}, [1, 100])).message).toContain('promptTokenIds');
  });

  it('treats top_logprobs as asking for logprobs', () => {
    expect(resolve({ topLogprobs: 3 }).sampling.logprobs).toBe(true);
  });
});
