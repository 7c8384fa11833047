import { describe, expect, it } from 'vitest';
import { isLoopbackHost } from '../src/auth/access-control.js';
import { credentialFrom } from '../src/auth/api-key.js';
import { formatReset, rateLimitHeaders } from '../src/auth/key-admission.js';
import { tokenReservation } from '../src/auth/token-reservation.js';
import { checkPrompt } from '../src/prompt-tokens.js';
import { loadGatewayConfig } from '../src/config.js';
import { GatewayError } from '../src/errors.js';
import { checkInputLimits } from '../src/openai/input-limits.js';
import { parseChatRequest, parseCompletionRequest } from '../src/openai/request-schemas.js';

const limits = loadGatewayConfig({
  MAX_TOKENS_LIMIT: '100',
  MAX_N: '2',
  MAX_STOP_SEQUENCES: '2',
  MAX_STOP_LENGTH: '5',
  MAX_MESSAGES: '3',
  MAX_USER_LENGTH: '8',
}).access;
const chat = (extra: Record<string, unknown>) => parseChatRequest({ model: 'm', messages: [{ role: 'user', content: 'hi' }], ...extra });

function refusal(run: () => void): { param: string | null; message: string } {
  try {
    run();
  } catch (error) {
    expect(error).toBeInstanceOf(GatewayError);
    expect((error as GatewayError).status).toBe(400);
    return { param: (error as GatewayError).param, message: (error as GatewayError).message };
  }
  throw new Error('not refused');
}

describe('input ceilings', () => {
  it('accepts a request within every ceiling', () => {
    expect(() => checkInputLimits(chat({ max_tokens: 100, n: 2, stop: ['a', 'bcdef'], user: '12345678' }), limits)).not.toThrow();
  });

  it('refuses each ceiling with a 400 naming the field the client sent', () => {
    expect(refusal(() => checkInputLimits(chat({ max_tokens: 101 }), limits)).param).toBe('max_tokens');
    expect(refusal(() => checkInputLimits(chat({ max_completion_tokens: 101 }), limits)).param).toBe('max_completion_tokens');
    expect(refusal(() => checkInputLimits(chat({ n: 3 }), limits)).param).toBe('n');
    expect(refusal(() => checkInputLimits(chat({ stop: ['a', 'b', 'c'] }), limits)).param).toBe('stop');
    expect(refusal(() => checkInputLimits(chat({ stop: 'abcdef' }), limits)).param).toBe('stop[0]');
    expect(refusal(() => checkInputLimits(chat({ user: '123456789' }), limits)).param).toBe('user');
    const four = Array.from({ length: 4 }, () => ({ role: 'user', content: 'x' }));
    expect(refusal(() => checkInputLimits(chat({ messages: four }), limits)).param).toBe('messages');
    expect(refusal(() => checkInputLimits(chat({ messages: [{ role: 'user', content: 'x', name: 'a-long-name' }] }), limits)).param).toBe(
      'messages[0].name',
    );
    expect(refusal(() => checkInputLimits(parseCompletionRequest({ model: 'm', prompt: 'p', max_tokens: 1000 }), limits)).message).toMatch(
      /at most 100/,
    );
  });
});

describe('access control pieces', () => {
  it('reads the key from Authorization: Bearer, else x-api-key', () => {
    expect(credentialFrom('Bearer abc', undefined)).toBe('abc');
    expect(credentialFrom('bearer\tabc ', undefined)).toBe('abc');
    expect(credentialFrom('Basic abc', 'xyz')).toBe('xyz');
    expect(credentialFrom('Bearer a b', undefined)).toBeUndefined();
    expect(credentialFrom(undefined, '  ')).toBeUndefined();
  });

  it('knows loopback addresses', () => {
    for (const host of ['127.0.0.1', '127.1.2.3', '::1', '[::1]', 'localhost']) expect(isLoopbackHost(host), host).toBe(true);
    for (const host of ['0.0.0.0', '::', '10.0.0.1', '192.168.1.2', 'example.com']) expect(isLoopbackHost(host), host).toBe(false);
  });

  it("writes reset times in OpenAI's duration format", () => {
    expect(formatReset(20)).toBe('20ms');
    expect(formatReset(1500)).toBe('1.5s');
    expect(formatReset(59_800)).toBe('59.8s');
    expect(formatReset(60_000)).toBe('1m0s');
    expect(formatReset(-5)).toBe('0ms');
  });

  it('sends the header trio of each limit the key has, and only those', () => {
    const headers = rateLimitHeaders({
      limits: { rpm: 10 },
      requestsUsed: 3,
      requestsResetMs: 1000,
      tokensUsed: 0,
      tokensResetMs: 0,
      streams: 0,
    });
    expect(headers).toEqual({
      'x-ratelimit-limit-requests': '10',
      'x-ratelimit-remaining-requests': '7',
      'x-ratelimit-reset-requests': '1s',
    });
    const tokens = rateLimitHeaders({
      limits: { tpm: 100 },
      requestsUsed: 0,
      requestsResetMs: 0,
      tokensUsed: 120,
      tokensResetMs: 0,
      streams: 0,
    });
    expect(tokens['x-ratelimit-remaining-tokens']).toBe('0');
  });

  it('reserves each prompt plus n times its completion limit as the gateway resolved it (the job carries the same)', () => {
    const model = { id: 'm', maxContextLength: 100, workers: 1 };
    const tokenizer = {
      maxContextLength: 100,
      vocabSize: 256,
      encodeChat: () => Array(30).fill(1),
      encodeText: (text: string) => [...text].map(() => 1),
      decode: () => '',
    };
    const checked = (request: ReturnType<typeof chat>) =>
      request.prompts === undefined
        ? [checkPrompt(request, tokenizer, model)]
        : request.prompts.map((input) => checkPrompt({ ...request, input }, tokenizer, model));
    const withN = chat({ max_tokens: 10, n: 2 });
    expect(tokenReservation(withN.n, checked(withN))).toBe(30 + 20);
    // No max_tokens: the context left after the prompt.
    expect(tokenReservation(1, checked(chat({})))).toBe(30 + 70);
    // ... within the smallest KV cache of the workers, split over the n choices.
    const cached = { ...model, maxCachedTokens: 120 };
    const n2 = chat({ n: 2 });
    expect(tokenReservation(2, [checkPrompt(n2, tokenizer, cached)])).toBe(30 + 2 * 30);
    const batch = parseCompletionRequest({ model: 'm', prompt: ['a', 'bb'], n: 1 });
    expect(tokenReservation(1, checked(batch))).toBe(1 + 16 + 2 + 16);
  });
});
