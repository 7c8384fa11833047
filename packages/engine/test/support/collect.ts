import type { EngineEvent, TokenLogprob } from '../../src/index.js';

export interface Collected {
  tokens: number[][];
  texts: string[];
  logprobs: TokenLogprob[][];
  endReasons: string[];
  finish: Extract<EngineEvent, { type: 'finish' }>;
  events: EngineEvent[];
}

/** Reads a whole stream into per-choice token ids, texts and finish reasons. */
export async function collect(stream: AsyncIterable<EngineEvent>, onDelta?: (tokensSoFar: number) => void): Promise<Collected> {
  const tokens: number[][] = [];
  const texts: string[] = [];
  const logprobs: TokenLogprob[][] = [];
  const endReasons: string[] = [];
  const events: EngineEvent[] = [];
  let finish: Collected['finish'] | undefined;
  let count = 0;
  for await (const event of stream) {
    events.push(event);
    if (event.type === 'text-delta') {
      (tokens[event.index] ??= []).push(...event.tokenIds);
      texts[event.index] = (texts[event.index] ?? '') + event.text;
      if (event.logprobs !== undefined) (logprobs[event.index] ??= []).push(...event.logprobs);
      count += event.tokenIds.length;
      onDelta?.(count);
    } else if (event.type === 'text-end') {
      endReasons[event.index] = event.finishReason;
    } else if (event.type === 'scheduled') {
      continue;
    } else {
      finish = event;
    }
  }
  if (finish === undefined) throw new Error('stream ended without a finish event');
  return { tokens, texts, logprobs, endReasons, finish, events };
}
