import { BYTE_TO_CHAR, preTokenize, toByteLevel } from './byte-level.js';

/** A learned byte-level BPE vocabulary. */
export interface ByteLevelBpe {
  /** Token strings in id order: the 256 byte characters (byte order), then one per new merge result. */
  tokens: string[];
  /** Merges in rank order, each a pair of existing tokens. */
  merges: Array<[string, string]>;
}

/**
 * Learns byte-level BPE merges from a text, deterministically: the same text and size always give
 * the same vocabulary, on any machine.
 *
 * The text is pre-tokenized with the GPT-2 pattern (merges never cross a piece boundary), each piece
 * is spelled in byte-level characters, and the most frequent adjacent pair is merged repeatedly.
 * Ties go to the pair whose `left + ' ' + right` sorts first (by UTF-16 code units), so no ordering
 * of a hash map ever leaks into the result.
 *
 * @param vocabSize Number of tokens to reach (bytes included); the text must allow that many.
 */
export function trainByteLevelBpe(text: string, vocabSize: number): ByteLevelBpe {
  const tokens = [...BYTE_TO_CHAR];
  const known = new Set(tokens);
  const merges: Array<[string, string]> = [];

  // Distinct pieces with their counts; each piece is a mutable list of symbols.
  const pieceCounts = new Map<string, number>();
  for (const piece of preTokenize(text)) {
    const key = toByteLevel(piece);
    pieceCounts.set(key, (pieceCounts.get(key) ?? 0) + 1);
  }
  const words = [...pieceCounts.keys()].sort().map((key) => ({ symbols: [...key], count: pieceCounts.get(key) as number }));

  // Pair counts and, for each pair, the words that contain it.
  const pairCounts = new Map<string, number>();
  const pairWords = new Map<string, Set<number>>();
  const addPairs = (index: number, sign: 1 | -1): void => {
    const word = words[index] as { symbols: string[]; count: number };
    for (let i = 0; i + 1 < word.symbols.length; i++) {
      const pair = `${word.symbols[i]} ${word.symbols[i + 1]}`;
      pairCounts.set(pair, (pairCounts.get(pair) ?? 0) + sign * word.count);
      if (sign > 0) {
        let set = pairWords.get(pair);
        if (set === undefined) pairWords.set(pair, (set = new Set()));
        set.add(index);
      }
    }
  };
  words.forEach((_, index) => addPairs(index, 1));

  while (tokens.length < vocabSize) {
    let best: string | undefined;
    let bestCount = 0;
    for (const [pair, count] of pairCounts) {
      if (count > bestCount || (count === bestCount && count > 0 && best !== undefined && pair < best)) {
        best = pair;
        bestCount = count;
      }
    }
    if (best === undefined || bestCount <= 0) {
      throw new Error(`the corpus allows only ${tokens.length} byte-level BPE tokens, ${vocabSize} were asked for`);
    }
    const [left, right] = best.split(' ') as [string, string];
    const merged = left + right;
    merges.push([left, right]);
    if (!known.has(merged)) {
      known.add(merged);
      tokens.push(merged);
    }

    const affected = [...(pairWords.get(best) ?? [])].sort((a, b) => a - b);
    for (const index of affected) {
      const word = words[index] as { symbols: string[]; count: number };
      addPairs(index, -1);
      const next: string[] = [];
      for (let i = 0; i < word.symbols.length; i++) {
        if (word.symbols[i] === left && word.symbols[i + 1] === right) {
          next.push(merged);
          i++;
        } else {
          next.push(word.symbols[i] as string);
        }
      }
      word.symbols = next;
      addPairs(index, 1);
    }
    pairCounts.delete(best);
    pairWords.delete(best);
    for (const [pair, count] of pairCounts) if (count === 0) pairCounts.delete(pair);
  }
  return { tokens, merges };
}
