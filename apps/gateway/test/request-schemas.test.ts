import { describe, expect, it } from 'vitest';
import { GatewayError } from '../src/errors.js';
import { parseChatRequest, parseCompletionRequest } from '../src/openai/request-schemas.js';

function refusal(parse: () => unknown): GatewayError {
  try {
    parse();
  } catch (error) {
    if (error instanceof GatewayError) return error;
    throw error;
  }
  throw new Error('not refused');
}

describe('chat requests', () => {
  it('maps OpenAI fields to engine sampling, treating null as unset', () => {
    const parsed = parseChatRequest({
      model: 'm',
      messages: [{ role: 'system', content: 'be brief' }, { role: 'user', content: [{ type: 'text', text: 'a' }, { type: 'text', text: 'b' }] }],
      max_completion_tokens: 7,
      temperature: 0,
      top_p: null,
      stop: 'END',
      seed: 3,
      stream: true,
      stream_options: { include_usage: true },
      logprobs: true,
      top_logprobs: 2,
      user: 'u1',
    });
    expect(parsed).toMatchObject({
      endpoint: 'chat',
      input: { kind: 'chat', messages: [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'ab' }] },
      sampling: { maxTokens: 7, temperature: 0, stop: ['END'], seed: 3, logprobs: true, topLogprobs: 2 },
      defaultMaxTokens: 'context',
      stream: true,
      includeUsage: true,
      maxTokensParam: 'max_completion_tokens',
      user: 'u1',
    });
    expect(parsed.sampling).not.toHaveProperty('topP');
  });

  it('names the field at fault', () => {
    expect(refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 5 }] })).param).toBe('messages[0].content');
    expect(refusal(() => parseChatRequest({ model: 'm' })).param).toBe('messages');
    expect(refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 'x' }], stream_options: {} })).param).toBe('stream_options');
    expect(refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 'x' }], tools: [{}] })).param).toBe('tools');
    expect(refusal(() => parseChatRequest([])).status).toBe(400);
  });
});

describe('completion requests', () => {
  it('accepts a string, one-string array, token ids or one token-id array as the prompt', () => {
    expect(parseCompletionRequest({ model: 'm', prompt: 'hi' }).input).toEqual({ kind: 'text', prompt: 'hi' });
    expect(parseCompletionRequest({ model: 'm', prompt: ['hi'] }).input).toEqual({ kind: 'text', prompt: 'hi' });
    expect(parseCompletionRequest({ model: 'm', prompt: [1, 2] }).input).toEqual({ kind: 'tokens', promptTokenIds: [1, 2] });
    expect(parseCompletionRequest({ model: 'm', prompt: [[1, 2]] }).input).toEqual({ kind: 'tokens', promptTokenIds: [1, 2] });
    expect(parseCompletionRequest({ model: 'm', prompt: 'hi' }).defaultMaxTokens).toBe(16);
  });

  it('refuses several prompts, echo and best_of, naming them', () => {
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: ['a', 'b'] })).param).toBe('prompt');
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', echo: true })).param).toBe('echo');
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', best_of: 3 })).param).toBe('best_of');
  });

  it('turns logprobs: k into the sampled logprob plus k alternatives', () => {
    expect(parseCompletionRequest({ model: 'm', prompt: 'a', logprobs: 3 }).sampling).toMatchObject({ logprobs: true, topLogprobs: 3 });
  });
});
