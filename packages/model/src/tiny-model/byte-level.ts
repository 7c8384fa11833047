/**
 * GPT-2's byte-level alphabet: every byte maps to one printable Unicode character, so a byte-level
 * BPE vocabulary is a set of ordinary strings (space is `Ġ`, newline `Ċ`) and covers any UTF-8 text.
 */

/** The 256 characters standing for bytes 0..255, in byte order. */
export const BYTE_TO_CHAR: readonly string[] = (() => {
  const printable: number[] = [];
  const range = (from: number, to: number): void => {
    for (let b = from; b <= to; b++) printable.push(b);
  };
  range(0x21, 0x7e); // '!' .. '~'
  range(0xa1, 0xac); // '¡' .. '¬'
  range(0xae, 0xff); // '®' .. 'ÿ'
  const chars: string[] = new Array<string>(256);
  let shifted = 0;
  for (let b = 0; b < 256; b++) {
    // Printable bytes stand for themselves; the others move to U+0100 and up, in byte order.
    chars[b] = String.fromCharCode(printable.includes(b) ? b : 256 + shifted++);
  }
  return chars;
})();

const encoder = new TextEncoder();

/** The byte-level characters of a string's UTF-8 bytes. */
export function toByteLevel(text: string): string {
  let out = '';
  for (const byte of encoder.encode(text)) out += BYTE_TO_CHAR[byte];
  return out;
}

/**
 * GPT-2's pre-tokenization pattern (the `use_regex: true` split of the ByteLevel pre-tokenizer):
 * contractions, letter runs, digit runs and symbol runs, each with at most one leading space.
 */
export const GPT2_SPLIT_PATTERN = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;

/** Splits text into the pieces BPE merges never cross. */
export function preTokenize(text: string): string[] {
  return text.match(GPT2_SPLIT_PATTERN) ?? [];
}
