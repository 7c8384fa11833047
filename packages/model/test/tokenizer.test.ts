import { describe, expect, it } from 'vitest';
import { loadTokenizer } from '../src/tokenizer.js';
import { byteLevelTokenizerJson } from './fixtures/byte-level-tokenizer.js';
import { sentencePieceTokenizerConfig, sentencePieceTokenizerJson } from './fixtures/sentencepiece-tokenizer.js';
import { qwen3Tokenizer, sentencePieceTokenizer } from './fixtures/tokenizers.js';

describe('loadTokenizer with the real Qwen3 tokenizer', () => {
  const tokenizer = qwen3Tokenizer();

  it('knows its vocabulary size, added tokens included', () => {
    expect(tokenizer.vocabSize).toBe(151669);
    expect(tokenizer.tokenToId('<|im_end|>')).toBe(151645);
    expect(tokenizer.tokenToId('<no such token>')).toBeUndefined();
  });

  it('round-trips Unicode text', () => {
    const text = 'Hello 👋🏽 world! 你好，世界 👨‍👩‍👧 naïve café\n\tcode: x = a .b';
    expect(tokenizer.decode(tokenizer.encode(text))).toBe(text);
  });

  it('encodes special tokens written in the text as single ids', () => {
    expect(tokenizer.encode('<|im_start|>user\nHi<|im_end|>')).toEqual([151644, 872, 198, 13048, 151645]);
  });

  it('skips special tokens when decoding unless told not to, keeping non-special added tokens', () => {
    const ids = tokenizer.encode('<|im_start|><think>ok</think><|im_end|>');
    expect(tokenizer.decode(ids)).toBe('<think>ok</think>');
    expect(tokenizer.decode(ids, { skipSpecialTokens: false })).toBe('<|im_start|><think>ok</think><|im_end|>');
  });

  it('tells special tokens apart, additional_special_tokens included', () => {
    expect(tokenizer.isSpecial(151645)).toBe(true);
    expect(tokenizer.isSpecial(151643)).toBe(true);
    expect(tokenizer.isSpecial(151667)).toBe(false); // <think>
    expect(tokenizer.isSpecial(9707)).toBe(false);
  });

  it('decodes ids outside the vocabulary and empty input to nothing', () => {
    expect(tokenizer.decode([])).toBe('');
    expect(tokenizer.decode([9707, 151900, 151935])).toBe('Hello');
  });

  it('never applies clean_up_tokenization_spaces', () => {
    const config = { clean_up_tokenization_spaces: true };
    const gpt2Like = loadTokenizer(byteLevelTokenizerJson(), config);
    expect(gpt2Like.decode(gpt2Like.encode('a . b , c'))).toBe('a . b , c');
  });
});

describe('loadTokenizer with a SentencePiece-style (Llama) tokenizer', () => {
  const tokenizer = sentencePieceTokenizer('llama');

  it('adds BOS only when asked to add special tokens', () => {
    expect(tokenizer.encode('hello')[0]).not.toBe(1);
    expect(tokenizer.encode('hello', { addSpecialTokens: true })[0]).toBe(1);
  });

  it('decodes without the leading space SentencePiece adds, and through byte fallback', () => {
    expect(tokenizer.decode(tokenizer.encode('hello world 😀', { addSpecialTokens: true }))).toBe('hello world 😀');
  });

  it('reads special tokens written as AddedToken objects in tokenizer_config.json', () => {
    const withAdditional = loadTokenizer(sentencePieceTokenizerJson('llama'), {
      ...sentencePieceTokenizerConfig,
      additional_special_tokens: [{ content: 'he', special: true }],
    });
    expect(withAdditional.isSpecial(withAdditional.tokenToId('he')!)).toBe(true);
    expect(withAdditional.decode(withAdditional.encode('hello'))).toBe('llo');
  });
});

describe('loadTokenizer input checks', () => {
  it('rejects JSON that is not a tokenizer', () => {
    expect(() => loadTokenizer([], {})).toThrow(/JSON object/);
    expect(() => loadTokenizer({ added_tokens: [] }, {})).toThrow(/"model"/);
  });
});
