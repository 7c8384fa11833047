import type { EngineEvent, TokenLogprob } from '@sluice/engine';
import type { GatewayEntryDraft, TokenLogprobWire } from '@sluice/protocol';

/** An entry before it is numbered and named for its request. */
export type EntryDraft = GatewayEntryDraft extends infer E ? (E extends GatewayEntryDraft ? Omit<E, 'requestId'> : never) : never;

/** What turning a request's engine events into entries carries from one event to the next. */
export interface EntryState {
  /** Tokens per choice whose text the detokenizer still holds back, and their ids. */
  held: Array<{ tokens: number; ids: number[] } | undefined>;
  /** The latest choice's stop/length (with n > 1, the last choice to finish decides the outcome). */
  lastFinishReason?: 'stop' | 'length';
}

/**
 * The entries one engine event makes for its request's log and live stream, in order: none for a
 * delta whose text is held back (its tokens ride on the choice's next delta) nor for `finish` (the
 * request's end is its processor's to write).
 */
export function eventEntries(state: EntryState, event: EngineEvent): EntryDraft[] {
  switch (event.type) {
    case 'text-delta': {
      const held = state.held[event.index];
      const tokens = event.tokenIds.length + (held?.tokens ?? 0);
      const tokenIds = held === undefined ? event.tokenIds : [...held.ids, ...event.tokenIds];
      if (event.text === '' && event.logprobs === undefined) {
        // Text held back (an incomplete UTF-8 sequence).
        state.held[event.index] = { tokens, ids: tokenIds };
        return [];
      }
      state.held[event.index] = undefined;
      return [
        {
          type: 'text-delta',
          index: event.index,
          text: event.text,
          tokens,
          tokenIds,
          ...(event.logprobs === undefined ? {} : { logprobs: event.logprobs.map(toWireLogprob) }),
        },
      ];
    }
    case 'text-end': {
      const entries: EntryDraft[] = [];
      // Tokens whose text never showed (held back to the end): an empty delta carries them.
      const held = state.held[event.index];
      if (held !== undefined) entries.push({ type: 'text-delta', index: event.index, text: '', tokens: held.tokens, tokenIds: held.ids });
      state.held[event.index] = undefined;
      if (event.finishReason === 'stop' || event.finishReason === 'length') state.lastFinishReason = event.finishReason;
      if (event.finishReason !== 'error') entries.push({ type: 'text-end', index: event.index, finishReason: event.finishReason });
      return entries;
    }
    case 'scheduled':
      return [{ type: 'scheduled' }];
    case 'finish':
      return [];
  }
}

function toWireLogprob(lp: TokenLogprob): TokenLogprobWire {
  const out: TokenLogprobWire = { token: lp.token, logprob: lp.logprob };
  if (lp.bytes !== undefined) out.bytes = lp.bytes;
  if (lp.topLogprobs !== undefined) {
    out.top = lp.topLogprobs.map((t) =>
      t.bytes === undefined ? { token: t.token, logprob: t.logprob } : { token: t.token, logprob: t.logprob, bytes: t.bytes },
    );
  }
  return out;
}
