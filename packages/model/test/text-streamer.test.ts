import { describe, expect, it } from 'vitest';
import { TextStreamer, type TextStreamerOptions } from '../src/text-streamer.js';
import type { TextDelta, Tokenizer } from '../src/types.js';
import { byteLevelChars, qwen3Tokenizer, sentencePieceTokenizer } from './fixtures/tokenizers.js';

function stream(tokenizer: Tokenizer, ids: readonly number[], options: TextStreamerOptions = {}): TextDelta[] {
  const streamer = new TextStreamer(tokenizer, options);
  const deltas = ids.map((id) => streamer.push(id));
  deltas.push(streamer.finish());
  return deltas;
}

/** Wraps a tokenizer to record the length of every window it decodes. */
function countingDecodes(tokenizer: Tokenizer): { counting: Tokenizer; windows: number[] } {
  const windows: number[] = [];
  const counting: Tokenizer = {
    vocabSize: tokenizer.vocabSize,
    encode: (text, options) => tokenizer.encode(text, options),
    tokenToId: (token) => tokenizer.tokenToId(token),
    isSpecial: (id) => tokenizer.isSpecial(id),
    decode: (ids, options) => {
      windows.push(ids.length);
      return tokenizer.decode(ids, options);
    },
  };
  return { counting, windows };
}

const joined = (deltas: readonly TextDelta[]): string => deltas.map((delta) => delta.text).join('');
const tokenSum = (deltas: readonly TextDelta[]): number => deltas.reduce((sum, delta) => sum + delta.tokens, 0);

describe('TextStreamer with a byte-level BPE tokenizer (Qwen3)', () => {
  const tokenizer = qwen3Tokenizer();
  const byteChars = byteLevelChars();
  const byteToken = (byte: number): number => {
    const id = tokenizer.tokenToId(byteChars[byte]!);
    if (id === undefined) throw new Error(`no token for byte ${byte}`);
    return id;
  };

  it('streams plain text token by token', () => {
    const ids = tokenizer.encode('Hello world, how are you?');
    const deltas = stream(tokenizer, ids);
    expect(joined(deltas)).toBe('Hello world, how are you?');
    expect(deltas.slice(0, ids.length).every((delta) => delta.text.length > 0 && delta.tokens === 1)).toBe(true);
  });

  it('holds back an incomplete UTF-8 sequence', () => {
    // 😀 is F0 9F 98 80: fed one byte token at a time.
    const ids = [...tokenizer.encode('ok '), ...[0xf0, 0x9f, 0x98, 0x80].map(byteToken)];
    const streamer = new TextStreamer(tokenizer, {});
    const deltas = ids.map((id) => streamer.push(id));
    expect(deltas.map((delta) => delta.text)).toEqual(['ok', ' ', '', '', '', '😀']);
    expect(deltas.at(-1)?.tokens).toBe(4);
    expect(streamer.finish()).toEqual({ text: '', tokens: 0 });
  });

  it('emits a trailing incomplete sequence at the end as decode() renders it', () => {
    const ids = [...tokenizer.encode('a'), byteToken(0xe4), byteToken(0xbd)];
    const deltas = stream(tokenizer, ids);
    expect(deltas.map((delta) => delta.text)).toEqual(['a', '', '', '\uFFFD']);
    expect(joined(deltas)).toBe(tokenizer.decode(ids));
    expect(tokenSum(deltas)).toBe(3);
  });

  it('keeps streaming through invalid bytes that can never form a character', () => {
    const invalid = Array.from({ length: 80 }, () => byteToken(0x80));
    const ids = [...invalid, ...tokenizer.encode(' fine')];
    const { counting, windows } = countingDecodes(tokenizer);
    const deltas = stream(counting, ids);
    expect(joined(deltas)).toBe(tokenizer.decode(ids));
    expect(Math.max(...windows)).toBeLessThanOrEqual(40);
    expect(deltas.slice(0, 40).some((delta) => delta.text.includes('\uFFFD'))).toBe(true);
  });

  it('skips special tokens and counts them where text is released', () => {
    const ids = tokenizer.encode('<|im_start|>assistant\nHi<|im_end|>');
    const deltas = stream(tokenizer, ids);
    expect(joined(deltas)).toBe('assistant\nHi');
    expect(tokenSum(deltas)).toBe(ids.length);
    expect(deltas.at(-1)).toEqual({ text: '', tokens: 1 });
  });

  it('keeps special tokens when skipSpecialTokens is false', () => {
    const ids = tokenizer.encode('Hi<|im_end|>');
    expect(joined(stream(tokenizer, ids, { skipSpecialTokens: false }))).toBe('Hi<|im_end|>');
  });

  it('stops before a stop string split across tokens and never emits it', () => {
    const ids = tokenizer.encode('The answer is 42. END of story');
    const deltas = stream(tokenizer, ids, { stop: ['END'] });
    expect(joined(deltas)).toBe('The answer is 42. ');
    const stopDelta = deltas.find((delta) => delta.finishReason === 'stop');
    expect(stopDelta).toBeDefined();
    expect(deltas.filter((delta) => delta.finishReason === 'stop')).toHaveLength(1);
    expect(tokenSum(deltas)).toBe(ids.length);
  });

  it('holds back text that could still begin a stop string', () => {
    const streamer = new TextStreamer(tokenizer, { stop: ['</answer>'] });
    const texts = ['x', ' </', 'ans'].flatMap((piece) => tokenizer.encode(piece)).map((id) => streamer.push(id).text);
    expect(texts.join('')).toBe('x ');
    expect(streamer.finish().text).toBe('</ans');
  });

  it('matches the earliest of several stop strings', () => {
    const ids = tokenizer.encode('one two three four');
    expect(joined(stream(tokenizer, ids, { stop: ['four', 'two', 'hre'] }))).toBe('one ');
  });

  it('matches a stop string that spans a held-back multi-byte character', () => {
    const ids = [...tokenizer.encode('go '), ...[0xf0, 0x9f, 0x98, 0x80].map(byteToken), ...tokenizer.encode('!')];
    expect(joined(stream(tokenizer, ids, { stop: ['😀!'] }))).toBe('go ');
  });

  it('produces nothing after a stop but still counts the tokens', () => {
    const streamer = new TextStreamer(tokenizer, { stop: ['b'] });
    const [a, b, c] = tokenizer.encode('a b c').map((id) => streamer.push(id));
    expect(a).toEqual({ text: 'a', tokens: 1 });
    expect(b).toEqual({ text: ' ', tokens: 1, finishReason: 'stop' });
    expect(c).toEqual({ text: '', tokens: 1 });
    expect(streamer.stopped).toBe(true);
    expect(streamer.finish()).toEqual({ text: '', tokens: 0 });
  });

  it('refuses tokens after finish()', () => {
    const streamer = new TextStreamer(tokenizer, {});
    streamer.finish();
    expect(() => streamer.push(1)).toThrow(/after finish/);
  });

  it('decodes only a short window per token', () => {
    const { counting, windows } = countingDecodes(tokenizer);
    const ids = tokenizer.encode('lorem ipsum dolor sit amet '.repeat(60));
    expect(joined(stream(counting, ids))).toBe(tokenizer.decode(ids));
    expect(Math.max(...windows)).toBeLessThanOrEqual(4);
  });
});

describe('TextStreamer with SentencePiece-style tokenizers', () => {
  for (const flavour of ['llama', 'metaspace'] as const) {
    it(`keeps the spaces that a ${flavour} decoder strips from a window's first token`, () => {
      const tokenizer = sentencePieceTokenizer(flavour);
      const text = 'hello world  the 你好 é x\nthe end';
      const ids = tokenizer.encode(text);
      const deltas = stream(tokenizer, ids);
      expect(joined(deltas)).toBe(tokenizer.decode(ids));
      expect(tokenSum(deltas)).toBe(ids.length);
    });
  }

  it('keeps a leading space after a skipped special token in the middle', () => {
    const tokenizer = sentencePieceTokenizer('llama');
    const ids = [...tokenizer.encode('hello'), 2, ...tokenizer.encode('hello world').slice(0), 2, 1];
    expect(joined(stream(tokenizer, ids))).toBe(tokenizer.decode(ids));
  });

  it('keeps the leading space after a long run of skipped special tokens', () => {
    const tokenizer = sentencePieceTokenizer('llama');
    const world = tokenizer.tokenToId('\u2581world')!;
    const ids = [...tokenizer.encode('hello'), ...Array.from({ length: 70 }, () => 2), world, world];
    expect(joined(stream(tokenizer, ids))).toBe('hello world world');
  });

  it('assembles byte-fallback tokens into one character', () => {
    const tokenizer = sentencePieceTokenizer('llama');
    const ids = tokenizer.encode('a 😀 b');
    const deltas = stream(tokenizer, ids);
    expect(joined(deltas)).toBe('a 😀 b');
    expect(deltas.some((delta) => delta.text.includes('\uFFFD'))).toBe(false);
  });
});
