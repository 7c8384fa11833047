import { decodeLogRange } from './token-log.js';

/** Where a request stood when its worker was lost, as its token log tells it. */
export interface LogState {
  /** Sequence number of the last entry (-1: none). */
  lastSeq: number;
  /** The seed the first attempt ran with. */
  seed: number | undefined;
  /** The prompt's length in tokens, as the first `accepted` said (0: none in the log). */
  promptTokens: number;
  /** Per choice: the token ids sent so far, and whether the choice ended. */
  choices: Array<{ tokenIds: number[]; ended: boolean }>;
  /** The request already finished (or failed): nothing to continue. */
  ended: boolean;
  /**
   * The log holds every entry from seq 0 on, none missing: what it says of the choices is the whole
   * answer so far. False once its cap (`STREAM_MAX_ENTRIES`) trimmed its start.
   */
  whole: boolean;
}

/** Reads an XRANGE of a request's token log (see packages/protocol token-log.ts). */
export function readLog(range: Array<[string, string[]]> | undefined, n: number): LogState {
  const entries = decodeLogRange(range);
  const state: LogState = {
    lastSeq: -1,
    seed: undefined,
    promptTokens: 0,
    choices: Array.from({ length: n }, () => ({ tokenIds: [], ended: false })),
    ended: false,
    whole: true,
  };
  for (const entry of entries) {
    if (entry.seq !== state.lastSeq + 1) state.whole = false;
    state.lastSeq = entry.seq;
    switch (entry.type) {
      case 'accepted':
        state.seed ??= entry.seed;
        state.promptTokens ||= entry.promptTokens;
        break;
      case 'scheduled':
        break;
      case 'text-delta':
        state.choices[entry.index]?.tokenIds.push(...(entry.tokenIds ?? []));
        break;
      case 'text-end': {
        const choice = state.choices[entry.index];
        if (choice !== undefined) choice.ended = true;
        break;
      }
      default:
        state.ended = true;
    }
  }
  return state;
}

/** The choices the log has not ended, by index. */
export function openChoices(state: LogState): number[] {
  return state.choices.flatMap((choice, index) => (choice.ended ? [] : [index]));
}

/** The completion tokens the log holds, all choices. */
export function sentTokens(state: LogState): number {
  return state.choices.reduce((sum, choice) => sum + choice.tokenIds.length, 0);
}
