import type { TextDelta, Tokenizer } from './types.js';

/** Options of {@link TextStreamer}. */
export interface TextStreamerOptions {
  /**
   * Stop strings (OpenAI `stop`): the stream ends right before the first one to appear in the text
   * (when several complete with the same token, the one that starts first), which is never emitted.
   * Matching is on decoded text, so a stop string can span tokens. Empty strings are ignored.
   * @defaultValue []
   */
  stop?: readonly string[];
  /** Drop special tokens (`<|im_end|>`, ...) from the text, as `decode()` does. @defaultValue true */
  skipSpecialTokens?: boolean;
}

const REPLACEMENT_CHAR = 0xfffd;
/**
 * Trailing U+FFFD characters held back: an unfinished UTF-8 sequence decodes to one (a byte-fallback
 * decoder that replaces per byte: up to three); earlier ones can no longer change.
 */
const MAX_PROVISIONAL_CHARS = 3;
/** Window length (tokens) past which a window that never comes clean is cut short. */
const MAX_WINDOW_TOKENS = 32;
/** Tokens kept in a window that is cut short: enough to hold an unfinished UTF-8 sequence. */
const REANCHOR_KEEP_TOKENS = 4;

/**
 * Streaming detokenizer: turns generated token ids, one at a time, into text deltas.
 *
 * Decodes a small window of recent ids per token, never the whole sequence (the prefix/read
 * offset technique of TGI and vLLM): the window starts a few tokens back so that decoders which
 * treat the first token specially (Metaspace / SentencePiece drop its leading space) see the same
 * context as a full decode, and the new text is the window's text past what it already produced.
 *
 * Guarantees, for any tokenizer whose decoding only appends as ids are appended once the text
 * ends cleanly (byte-level BPE, byte-fallback SentencePiece), and whose `skipSpecialTokens` drops
 * exactly the ids `isSpecial()` reports:
 * - the deltas' texts concatenate to `tokenizer.decode(ids, { skipSpecialTokens })` when no stop
 *   string matched, and to that text cut before the first stop string when one did;
 * - no delta ends in an unfinished UTF-8 sequence (those decode to U+FFFD and are held back), and
 *   no delta ends in text that could still begin a stop string;
 * - the sum of `tokens` over all deltas equals the number of ids pushed.
 */
export class TextStreamer {
  readonly #tokenizer: Tokenizer;
  readonly #skipSpecialTokens: boolean;
  readonly #stops: string[];
  readonly #maxStopLength: number;

  /** Ids from the start of the decode window on; earlier ids are dropped. */
  #ids: number[] = [];
  /** Where the window's already-emitted context ends (index into #ids). */
  #readOffset = 0;
  /** decode(#ids[0 .. #readOffset]). */
  #prefixText = '';
  /** Characters of decode(#ids) already handed to the stop-string stage. */
  #decodedLength = 0;
  /** Decoded text held back because it could be the beginning of a stop string. */
  #heldText = '';
  /** Tokens pushed since the last delta that carried text. */
  #pendingTokens = 0;
  #state: 'streaming' | 'stopped' | 'finished' = 'streaming';

  constructor(tokenizer: Tokenizer, options: TextStreamerOptions = {}) {
    this.#tokenizer = tokenizer;
    this.#skipSpecialTokens = options.skipSpecialTokens ?? true;
    this.#stops = (options.stop ?? []).filter((stop) => stop.length > 0);
    this.#maxStopLength = Math.max(0, ...this.#stops.map((stop) => stop.length));
  }

  /** True once a stop string matched: later tokens produce no text. */
  get stopped(): boolean {
    return this.#state === 'stopped';
  }

  /** Adds one generated token and returns the text that became safe to emit (possibly empty). */
  push(tokenId: number): TextDelta {
    if (this.#state === 'finished') throw new Error('TextStreamer.push() called after finish()');
    // After a stop string the request is over; the token still counts so that sums stay exact.
    if (this.#state === 'stopped') return { text: '', tokens: 1 };
    this.#pendingTokens += 1;
    // A skipped special token adds no text; keeping it out of the window keeps long runs of them
    // (a model told to ignore EOS) from growing the window.
    if (this.#skipSpecialTokens && this.#tokenizer.isSpecial(tokenId)) return { text: '', tokens: 0 };
    this.#ids.push(tokenId);

    const text = this.#decode(this.#ids);
    let stableEnd = text.length;
    while (
      stableEnd > this.#decodedLength &&
      text.length - stableEnd < MAX_PROVISIONAL_CHARS &&
      text.charCodeAt(stableEnd - 1) === REPLACEMENT_CHAR
    ) {
      stableEnd -= 1;
    }
    const fresh = stableEnd > this.#decodedLength ? text.slice(this.#decodedLength, stableEnd) : '';
    this.#decodedLength = Math.max(this.#decodedLength, stableEnd);

    if (stableEnd === text.length && text.length > this.#prefixText.length) {
      this.#advanceWindow();
    } else if (this.#ids.length > MAX_WINDOW_TOKENS && this.#ids.length % REANCHOR_KEEP_TOKENS === 0) {
      this.#cutWindow(text);
    }
    return this.#release(fresh, false);
  }

  /**
   * Ends the stream: releases text held back for a possible stop string, and a trailing unfinished
   * UTF-8 sequence as `decode()` renders it. Call once; `push()` is not allowed afterwards.
   */
  finish(): TextDelta {
    if (this.#state !== 'streaming') {
      this.#state = 'finished';
      return { text: '', tokens: 0 };
    }
    const text = this.#ids.length > 0 ? this.#decode(this.#ids) : '';
    const delta = this.#release(text.slice(this.#decodedLength), true);
    if (this.#state === 'streaming') this.#state = 'finished';
    return delta;
  }

  /**
   * The window's text ended cleanly past its context: its tokens become the next window's context.
   * Decoding is prefix-stable from here on, so dropping older ids changes nothing downstream.
   */
  #advanceWindow(): void {
    this.#ids = this.#ids.slice(this.#readOffset);
    this.#readOffset = this.#ids.length;
    this.#prefixText = this.#decode(this.#ids);
    this.#decodedLength = this.#prefixText.length;
  }

  /**
   * A window that never comes clean (a run of invalid bytes, of skipped special tokens) would grow
   * without bound. Restart it a few tokens back when decoding the two parts separately gives the
   * same text and the kept part shows text, so the split cannot change a character or a leading
   * space.
   */
  #cutWindow(text: string): void {
    const cut = this.#ids.length - REANCHOR_KEEP_TOKENS;
    const head = this.#decode(this.#ids.slice(0, cut));
    if (head.length > this.#decodedLength) return;
    const tail = this.#decode(this.#ids.slice(cut));
    if (tail.length === 0 || head + tail !== text) return;
    this.#ids = this.#ids.slice(cut);
    this.#readOffset = 0;
    this.#prefixText = '';
    this.#decodedLength -= head.length;
  }

  /** Stop-string stage: emits what can no longer be part of a stop string. */
  #release(fresh: string, final: boolean): TextDelta {
    let text = this.#heldText + fresh;
    this.#heldText = '';
    if (this.#stops.length > 0) {
      const stopAt = this.#firstStop(text);
      if (stopAt >= 0) {
        this.#state = 'stopped';
        return { text: text.slice(0, stopAt), tokens: this.#takePendingTokens(), finishReason: 'stop' };
      }
      if (!final) {
        const holdFrom = this.#possibleStopStart(text);
        this.#heldText = text.slice(holdFrom);
        text = text.slice(0, holdFrom);
      }
    }
    if (text.length === 0 && !final) return { text: '', tokens: 0 };
    return { text, tokens: this.#takePendingTokens() };
  }

  #firstStop(text: string): number {
    let first = -1;
    for (const stop of this.#stops) {
      const at = text.indexOf(stop);
      if (at >= 0 && (first < 0 || at < first)) first = at;
    }
    return first;
  }

  /** Start of the longest suffix of `text` that is a proper prefix of a stop string (or text.length). */
  #possibleStopStart(text: string): number {
    for (let start = Math.max(0, text.length - this.#maxStopLength + 1); start < text.length; start++) {
      const suffix = text.slice(start);
      if (this.#stops.some((stop) => stop.startsWith(suffix))) {
        // Never split a surrogate pair between an emitted and a held part.
        return start > 0 && isLowSurrogate(text.charCodeAt(start)) ? start - 1 : start;
      }
    }
    return text.length;
  }

  #takePendingTokens(): number {
    const tokens = this.#pendingTokens;
    this.#pendingTokens = 0;
    return tokens;
  }

  #decode(ids: readonly number[]): string {
    return this.#tokenizer.decode(ids, { skipSpecialTokens: this.#skipSpecialTokens });
  }
}

function isLowSurrogate(code: number): boolean {
  return code >= 0xdc00 && code <= 0xdfff;
}
