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
      messages: [
        { role: 'system', content: 'be brief' },
        {
          role: 'user',
          content: [
            { type: 'text', text: 'a' },
            { type: 'text', text: 'b' },
          ],
        },
      ],
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
      input: {
        kind: 'chat',
        messages: [
          { role: 'system', content: 'be brief' },
          { role: 'user', content: 'ab' },
        ],
      },
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
    expect(refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 'x' }], stream_options: {} })).param).toBe(
      'stream_options',
    );
    expect(refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 'x' }], tools: [{}] })).param).toBe('tools');
    expect(refusal(() => parseChatRequest([])).status).toBe(400);
  });

  it('says what a field of several forms takes, or where inside it the value went wrong', () => {
    const content = refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 5 }] }));
    expect(content.message).toBe('messages[0].content: must be a string or an array, not a number.');
    const part = refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: [{ type: 'text', text: 5 }] }] }));
    expect(part.param).toBe('messages[0].content[0].text');
    expect(part.message).toMatch(/^messages\[0\]\.content\[0\]\.text: .*expected string, received number/);
    const stop = refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 'x' }], stop: ['a', 5] }));
    expect(stop.param).toBe('stop[1]');
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: {} })).message).toBe(
      'prompt: must be a string or an array, not an object.',
    );
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

  it('takes a batch of prompts, text or token ids, as one input per prompt', () => {
    const texts = parseCompletionRequest({ model: 'm', prompt: ['a', 'b'] });
    expect(texts.prompts).toEqual([
      { kind: 'text', prompt: 'a' },
      { kind: 'text', prompt: 'b' },
    ]);
    expect(texts.input).toEqual({ kind: 'text', prompt: 'a' });
    expect(parseCompletionRequest({ model: 'm', prompt: [[1], [2, 3]] }).prompts).toEqual([
      { kind: 'tokens', promptTokenIds: [1] },
      { kind: 'tokens', promptTokenIds: [2, 3] },
    ]);
    expect(parseCompletionRequest({ model: 'm', prompt: ['a'] }).prompts).toBeUndefined();
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: [] })).param).toBe('prompt');
  });

  it('refuses an empty list of prompts saying so, not "Invalid input"', () => {
    const empty = refusal(() => parseCompletionRequest({ model: 'm', prompt: [] }));
    expect(empty).toMatchObject({ param: 'prompt', message: 'prompt: must hold at least one prompt.' });
  });

  it('takes echo, but not with logprobs (prompt logprobs are not computed)', () => {
    expect(parseCompletionRequest({ model: 'm', prompt: 'a', echo: true }).echo).toBe(true);
    expect(parseCompletionRequest({ model: 'm', prompt: 'a', echo: false }).echo).toBeUndefined();
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', echo: true, logprobs: 1 })).param).toBe('echo');
  });

  it('refuses best_of and suffix, naming them', () => {
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', best_of: 3 })).param).toBe('best_of');
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', suffix: 'x' })).param).toBe('suffix');
  });

  it('takes logit_bias as [tokenId, bias] pairs, and names a key that is no token id or a bias outside [-100, 100]', () => {
    expect(parseCompletionRequest({ model: 'm', prompt: 'a', logit_bias: { '7': -100, '30': 2.5 } }).sampling.logitBias).toEqual([
      [7, -100],
      [30, 2.5],
    ]);
    expect(parseCompletionRequest({ model: 'm', prompt: 'a', logit_bias: {} }).sampling.logitBias).toBeUndefined();
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', logit_bias: { x: 1 } })).param).toBe('logit_bias.x');
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', logit_bias: { '-1': 1 } })).param).toBe('logit_bias.-1');
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', logit_bias: { '1': 101 } })).param).toBe('logit_bias.1');
  });

  it('turns logprobs: k into the sampled logprob plus k alternatives', () => {
    expect(parseCompletionRequest({ model: 'm', prompt: 'a', logprobs: 3 }).sampling).toMatchObject({ logprobs: true, topLogprobs: 3 });
  });
});

describe('fields the gateway does not support', () => {
  const chat = { model: 'm', messages: [{ role: 'user', content: 'x' }] };

  it.each([
    ['tools', { tools: [{ type: 'function', function: { name: 'f' } }] }],
    ['tool_choice', { tool_choice: 'auto' }],
    ['parallel_tool_calls', { parallel_tool_calls: false }],
    ['response_format.type', { response_format: { type: 'json_object' } }],
    ['audio', { audio: { voice: 'alloy', format: 'mp3' } }],
    ['modalities', { modalities: ['text', 'audio'] }],
    ['guided_json', { guided_json: { type: 'object' } }],
    ['functions', { functions: [{ name: 'f' }] }],
    ['stream_options.unknown', { stream: true, stream_options: { unknown: true } }],
    ['messages[0].tool_calls', { messages: [{ role: 'user', content: 'x', tool_calls: [] }] }],
  ])('refuses %s with a 400 naming it', (param, extra) => {
    const error = refusal(() => parseChatRequest({ ...chat, ...extra }));
    expect(error.status).toBe(400);
    expect(error.param).toBe(param);
    expect(error.message).toContain(param);
  });

  it('refuses completion-only and chat-only fields on the other endpoint', () => {
    expect(refusal(() => parseCompletionRequest({ model: 'm', prompt: 'a', tools: [] })).param).toBe('tools');
    expect(refusal(() => parseChatRequest({ ...chat, echo: true })).param).toBe('echo');
  });

  it('accepts the no-op values of unsupported features', () => {
    expect(() =>
      parseChatRequest({ ...chat, tools: [], tool_choice: 'none', response_format: { type: 'text' }, logit_bias: {}, store: false }),
    ).not.toThrow();
  });

  it('takes continuous_usage_stats, only with stream', () => {
    expect(parseChatRequest({ ...chat, stream: true, stream_options: { continuous_usage_stats: true } }).continuousUsage).toBe(true);
    expect(refusal(() => parseChatRequest({ ...chat, stream_options: { continuous_usage_stats: true } })).param).toBe('stream_options');
  });
});

describe('chat messages as OpenAI clients send them', () => {
  it('accepts an assistant message sent back as it was received (refusal, tool_calls, function_call and audio null or empty), without rendering them', () => {
    const parsed = parseChatRequest({
      model: 'm',
      messages: [
        { role: 'user', content: 'hi' },
        { role: 'assistant', content: 'hello', refusal: null, tool_calls: null, function_call: null, audio: null },
        { role: 'assistant', content: null, refusal: 'I cannot.', tool_calls: [] },
        { role: 'user', content: 'again' },
      ],
    });
    expect(parsed.input).toEqual({
      kind: 'chat',
      messages: [
        { role: 'user', content: 'hi' },
        { role: 'assistant', content: 'hello' },
        { role: 'assistant', content: '' },
        { role: 'user', content: 'again' },
      ],
    });
  });

  it('renders a developer message as the system message (OpenAI renamed it; chat templates know system)', () => {
    const parsed = parseChatRequest({
      model: 'm',
      messages: [
        { role: 'developer', content: 'be brief' },
        { role: 'user', content: 'hi' },
      ],
    });
    expect(parsed.input).toEqual({
      kind: 'chat',
      messages: [
        { role: 'system', content: 'be brief' },
        { role: 'user', content: 'hi' },
      ],
    });
  });

  it('accepts null for the OpenAI fields it does not support, and refuses a value naming the field', () => {
    const nulls = [
      'function_call',
      'metadata',
      'audio',
      'prediction',
      'reasoning_effort',
      'web_search_options',
      'parallel_tool_calls',
      'modalities',
    ];
    const base = { model: 'm', messages: [{ role: 'user', content: 'hi' }] };
    expect(() => parseChatRequest({ ...base, ...Object.fromEntries(nulls.map((field) => [field, null])) })).not.toThrow();
    for (const [field, value] of [
      ['metadata', { a: '1' }],
      ['reasoning_effort', 'low'],
      ['function_call', 'auto'],
      ['modalities', ['text']],
      ['parallel_tool_calls', false],
    ] as const) {
      const error = refusal(() => parseChatRequest({ ...base, [field]: value }));
      expect(error.param).toMatch(new RegExp(`^${field}`));
      expect(error.message).toMatch(/not supported/);
    }
    const toolCalls = refusal(() =>
      parseChatRequest({ model: 'm', messages: [{ role: 'assistant', content: 'x', tool_calls: [{ id: 'c' }] }] }),
    );
    expect(toolCalls.param).toBe('messages[0].tool_calls');
  });

  it('requires tool_call_id on a tool message and content on every message but an assistant one, as OpenAI does', () => {
    const tool = refusal(() =>
      parseChatRequest({
        model: 'm',
        messages: [
          { role: 'user', content: 'q' },
          { role: 'tool', content: '42' },
        ],
      }),
    );
    expect([tool.param, tool.message]).toEqual(['messages[1].tool_call_id', 'messages[1].tool_call_id: is required.']);
    expect(() =>
      parseChatRequest({
        model: 'm',
        messages: [
          { role: 'user', content: 'q' },
          { role: 'tool', content: '42', tool_call_id: 'call_1' },
        ],
      }),
    ).not.toThrow();
    const none = refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: null }] }));
    expect([none.param, none.message]).toEqual(['messages[0].content', 'messages[0].content: is required on a user message.']);
    const absent = refusal(() => parseChatRequest({ model: 'm', messages: [{ role: 'system' }, { role: 'user', content: 'q' }] }));
    expect([absent.param, absent.message]).toEqual(['messages[0].content', 'messages[0].content: is required.']);
  });
});
