import { describe, expect, it } from 'vitest';
import { qwen3Tokenizer, sentencePieceTokenizer } from './fixtures/tokenizers.js';

/** Each token's bytes, concatenated: must be the text's UTF-8, whatever the token boundaries. */
function bytesOf(tokenizer: ReturnType<typeof qwen3Tokenizer>, text: string): { ids: number[]; bytes: number[][] } {
  const ids = tokenizer.encode(text);
  return { ids, bytes: ids.map((id) => tokenizer.tokenBytes!(id)) };
}

describe('tokenBytes', () => {
  it('gives the raw vocabulary bytes of byte-level BPE tokens that hold part of a character (Qwen3)', () => {
    const tokenizer = qwen3Tokenizer();
    for (const text of ['🦊 in 東京', 'naïve café', ' ünïcödé ✓']) {
      const { ids, bytes } = bytesOf(tokenizer, text);
      expect(Buffer.from(bytes.flat()).toString('utf8')).toBe(text);
      // Some token of these holds part of a character: alone it decodes to U+FFFD, its bytes do not.
      if (text.startsWith('🦊')) {
        const partial = ids.findIndex((id) => tokenizer.decode([id]).includes('\uFFFD'));
        expect(partial).toBeGreaterThanOrEqual(0);
        expect(bytes[partial]).not.toEqual([0xef, 0xbf, 0xbd]);
      }
    }
  });

  it('reads SentencePiece byte-fallback tokens as their byte and ▁ as a space', () => {
    const tokenizer = sentencePieceTokenizer('llama');
    const { bytes } = bytesOf(tokenizer, 'a 🦊');
    expect(Buffer.from(bytes.flat()).toString('utf8').trim()).toBe('a 🦊');
  });

  it('gives a special token its text', () => {
    const tokenizer = qwen3Tokenizer();
    const id = tokenizer.tokenToId('<|im_end|>')!;
    expect(Buffer.from(tokenizer.tokenBytes!(id)).toString('utf8')).toBe('<|im_end|>');
  });
});
