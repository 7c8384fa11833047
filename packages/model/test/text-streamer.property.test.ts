import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { loadModelDir } from '../src/model-dir.js';
import { TextStreamer } from '../src/text-streamer.js';
import { ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import type { TextDelta, Tokenizer } from '../src/types.js';
import { byteLevelChars, qwen3Tokenizer, sentencePieceTokenizer } from './fixtures/tokenizers.js';

const NUM_RUNS = 200;

const char = (from: number, to: number): fc.Arbitrary<string> =>
  fc.integer({ min: from, max: to }).map((code) => String.fromCodePoint(code));

/** Emoji with optional skin tones and ZWJ joins, the sequences byte-level BPE splits mid-character. */
const emoji = fc
  .array(
    fc.tuple(
      fc.constantFrom('👋', '👍', '😀', '🧑', '👩', '👨', '👧', '❤️', '🏳️', '🌈', '🔥', '🇫🇷', '✅'),
      fc.option(char(0x1f3fb, 0x1f3ff), { nil: '' }),
    ),
    { minLength: 1, maxLength: 4 },
  )
  .map((parts) => parts.map(([base, tone]) => base + tone).join('\u200d'));

/** Random text mixing everything detokenizers get wrong. */
const unicodeText = fc
  .array(
    fc.oneof(
      fc.string({ unit: 'grapheme-ascii', maxLength: 12 }),
      fc.constantFrom(' ', '  ', '\n', '\n\n', '\t', ' the', ' hello', ' world', 'ing'),
      fc.string({ unit: char(0x4e00, 0x9fff), minLength: 1, maxLength: 6 }), // CJK
      fc.string({ unit: char(0x3040, 0x30ff), minLength: 1, maxLength: 4 }), // kana
      emoji,
      fc.tuple(char(0x61, 0x7a), fc.string({ unit: char(0x300, 0x36f), minLength: 1, maxLength: 3 })).map(
        ([letter, marks]) => letter + marks, // combining marks
      ),
      fc.string({ unit: 'grapheme', maxLength: 4 }),
      fc.constantFrom('<|im_end|>', '<|endoftext|>', '<think>', '<s>', '</s>'),
    ),
    { maxLength: 16 },
  )
  .map((pieces) => pieces.join(''));

function streamAll(tokenizer: Tokenizer, ids: readonly number[], options: { stop?: string[]; skipSpecialTokens?: boolean }): TextDelta[] {
  const streamer = new TextStreamer(tokenizer, options);
  const deltas = ids.map((id) => streamer.push(id));
  deltas.push(streamer.finish());
  return deltas;
}

/** Each delta is exactly the next slice of the full decode: nothing provisional is ever emitted. */
function expectDeltasToSpell(deltas: readonly TextDelta[], expected: string): void {
  let at = 0;
  for (const delta of deltas) {
    expect(delta.text).toBe(expected.slice(at, at + delta.text.length));
    at += delta.text.length;
  }
  expect(at).toBe(expected.length);
}

const tokenSum = (deltas: readonly TextDelta[]): number => deltas.reduce((sum, delta) => sum + delta.tokens, 0);

/** The earliest occurrence of any stop string (the stop sets below never nest one in another). */
function truncateAtStop(text: string, stops: readonly string[]): { text: string; stopped: boolean } {
  let first = -1;
  for (const stop of stops) {
    const at = stop === '' ? -1 : text.indexOf(stop);
    if (at >= 0 && (first < 0 || at < first)) first = at;
  }
  return first < 0 ? { text, stopped: false } : { text: text.slice(0, first), stopped: true };
}

/** Stop strings drawn from the decoded text (so they match) or made up; none contains another. */
function stopStringsFor(text: string): fc.Arbitrary<string[]> {
  const chars = Array.from(text);
  const fromText = fc
    .tuple(fc.nat({ max: Math.max(0, chars.length - 1) }), fc.integer({ min: 1, max: 6 }))
    .map(([start, length]) => chars.slice(start, start + length).join(''));
  const madeUp = fc.oneof(fc.string({ minLength: 1, maxLength: 4 }), fc.constantFrom('\n\n', '😀', '世界', 'END'));
  return fc
    .array(fc.oneof(fromText, madeUp), { minLength: 1, maxLength: 3 })
    .map((stops) => stops.filter((stop) => stop !== ''))
    .map((stops) => stops.filter((stop, i) => !stops.some((other, j) => j !== i && other.includes(stop) && (other !== stop || j < i))))
    .filter((stops) => stops.length > 0);
}

function streamingProperties(name: string, tokenizer: () => Tokenizer, rawIds: fc.Arbitrary<number[]>): void {
  describe(`TextStreamer with ${name}`, () => {
    it('spells exactly decode(ids) for encoded Unicode text, one safe delta at a time', () => {
      const tok = tokenizer();
      fc.assert(
        fc.property(unicodeText, fc.boolean(), (text, skipSpecialTokens) => {
          const ids = tok.encode(text);
          const deltas = streamAll(tok, ids, { skipSpecialTokens });
          expectDeltasToSpell(deltas, tok.decode(ids, { skipSpecialTokens }));
          expect(tokenSum(deltas)).toBe(ids.length);
          expect(deltas.some((delta) => delta.finishReason !== undefined)).toBe(false);
          // No half character: no replacement character the text lacks, no delta ending mid surrogate pair.
          if (!text.includes('\uFFFD')) expect(deltas.filter((delta) => delta.text.includes('\uFFFD'))).toEqual([]);
          expect(deltas.filter((delta) => /[\uD800-\uDBFF]$/.test(delta.text))).toEqual([]);
        }),
        { numRuns: NUM_RUNS },
      );
    });

    it('spells exactly decode(ids) for arbitrary token sequences, invalid UTF-8 included', () => {
      const tok = tokenizer();
      fc.assert(
        fc.property(rawIds, (ids) => {
          const deltas = streamAll(tok, ids, {});
          expectDeltasToSpell(deltas, tok.decode(ids));
          expect(tokenSum(deltas)).toBe(ids.length);
        }),
        { numRuns: NUM_RUNS },
      );
    });

    it('ends right before the first stop string and never emits it', () => {
      const tok = tokenizer();
      const withStops = unicodeText
        .map((text) => tok.encode(text))
        .chain((ids) => stopStringsFor(tok.decode(ids)).map((stops) => ({ ids, stops })));
      fc.assert(
        fc.property(withStops, ({ ids, stops }) => {
          const deltas = streamAll(tok, ids, { stop: stops });
          const expected = truncateAtStop(tok.decode(ids), stops);
          expectDeltasToSpell(deltas, expected.text);
          expect(tokenSum(deltas)).toBe(ids.length);
          const stopDeltas = deltas.filter((delta) => delta.finishReason === 'stop');
          expect(stopDeltas.length).toBe(expected.stopped ? 1 : 0);
        }),
        { numRuns: NUM_RUNS },
      );
    });
  });
}

/** Ids a model could sample from a byte-level vocabulary: lone bytes (often invalid UTF-8), words, specials. */
function byteLevelIds(tok: () => Tokenizer): fc.Arbitrary<number[]> {
  const byteChars = byteLevelChars();
  const byteId = fc.integer({ min: 0, max: 255 }).map((byte) => tok().tokenToId(byteChars[byte]!) ?? 0);
  const utf8Fragment = fc.tuple(unicodeText, fc.nat()).map(([text, skip]) =>
    tok()
      .encode(text)
      .slice(skip % 3),
  );
  return fc
    .array(
      fc.oneof(
        byteId.map((id) => [id]),
        utf8Fragment,
        fc.integer({ min: 0, max: tok().vocabSize - 1 }).map((id) => [id]),
        fc.integer({ min: tok().vocabSize, max: tok().vocabSize + 300 }).map((id) => [id]),
      ),
      { maxLength: 12 },
    )
    .map((chunks) => chunks.flat());
}

streamingProperties('the real Qwen3 tokenizer (byte-level BPE)', qwen3Tokenizer, byteLevelIds(qwen3Tokenizer));

const tinyTokenizer = (await loadModelDir(await ensureBuiltinModel('tiny'))).tokenizer;
streamingProperties(
  "the built-in tiny model's tokenizer",
  () => tinyTokenizer,
  byteLevelIds(() => tinyTokenizer),
);

for (const flavour of ['llama', 'metaspace'] as const) {
  let tok: Tokenizer | undefined;
  const tokenizer = (): Tokenizer => (tok ??= sentencePieceTokenizer(flavour));
  const rawIds = fc.array(fc.integer({ min: 0, max: tokenizer().vocabSize - 1 }), { maxLength: 40 });
  streamingProperties(`a SentencePiece-style tokenizer (${flavour})`, tokenizer, rawIds);
}
