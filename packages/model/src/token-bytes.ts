/**
 * The raw bytes a vocabulary entry stands for: what OpenAI's logprobs `bytes` carry. A token can hold
 * part of a UTF-8 character (a byte-level BPE token for the first two bytes of "é", a SentencePiece
 * byte-fallback token `<0xC3>`); decoding such a token alone gives U+FFFD, whose bytes are wrong.
 *
 * - Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each character of the token string stands for one
 *   byte through GPT-2's `bytes_to_unicode` table.
 * - SentencePiece byte fallback: `<0xHH>` is the byte HH; `▁` is a space.
 * - Anything else (added/special tokens, other models): the UTF-8 of the token's text.
 */

/** GPT-2's `bytes_to_unicode`, inverted: printable stand-in character → byte. */
function byteLevelTable(): Map<string, number> {
  const bytes: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) bytes.push(b);
  for (let b = 0xa1; b <= 0xac; b++) bytes.push(b);
  for (let b = 0xae; b <= 0xff; b++) bytes.push(b);
  const table = new Map<string, number>();
  for (const b of bytes) table.set(String.fromCodePoint(b), b);
  let extra = 0;
  for (let b = 0; b < 256; b++) {
    if (!bytes.includes(b)) table.set(String.fromCodePoint(256 + extra++), b);
  }
  return table;
}

let table: Map<string, number> | undefined;

/**
 * @param token the vocabulary string of the token (`id_to_token`)
 * @param byteLevel the tokenizer decodes with a ByteLevel decoder
 * @param text the token decoded alone: the fallback
 */
export function tokenBytes(token: string | undefined, byteLevel: boolean, text: string): number[] {
  if (token !== undefined) {
    const fallback = /^<0x([0-9A-Fa-f]{2})>$/.exec(token);
    if (fallback !== null) return [Number.parseInt(fallback[1]!, 16)];
    if (byteLevel) {
      table ??= byteLevelTable();
      const out: number[] = [];
      for (const char of token) {
        const byte = table.get(char);
        if (byte === undefined) return [...Buffer.from(text, 'utf8')];
        out.push(byte);
      }
      return out;
    }
    // SentencePiece: the vocabulary writes a space as ▁ (decoding a token alone may drop it).
    if (token.includes('\u2581')) return [...Buffer.from(token.replaceAll('\u2581', ' '), 'utf8')];
  }
  return [...Buffer.from(text, 'utf8')];
}
