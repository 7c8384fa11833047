import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import type { EngineEvent } from '@sluice/engine';
import { redisNames, type GatewayEntryDraft, type GenerateJob } from '@sluice/protocol';
import { JobProcessor } from '../src/processor.js';

/** A processor around an engine that replays `events`, recording what it would publish. */
function processorFor(events: EngineEvent[]) {
  const published: GatewayEntryDraft[] = [];
  const finished: Array<{ finishReason: string; completionTokens: number }> = [];
  const processor = new JobProcessor({
    engine: {
      info: { modelId: 'm', maxContextLength: 100, maxBatchSize: 4, executionProvider: 'cpu' },
      generate: () =>
        (async function* () {
          yield* events;
        })(),
    },
    prompts: { chat: () => [1, 2, 3], text: () => [1, 2, 3] },
    publisher: { push: (_channel: string, entry: GatewayEntryDraft) => published.push(entry), forget: () => {} } as never,
    cancels: { register: () => {}, unregister: () => {} } as never,
    redis: { exists: async () => 0 } as never,
    names: redisNames('t'),
    workerId: 'w1',
    logger: pino({ level: 'silent' }),
    hooks: { requestFinished: (s) => finished.push({ finishReason: s.finishReason, completionTokens: s.usage.completionTokens }) },
  });
  return { processor, published, finished };
}

const job: GenerateJob = {
  requestId: 'job-1',
  correlationId: 'client-1',
  channel: 'gw',
  model: 'm',
  input: { kind: 'text', prompt: 'hi' },
  sampling: { maxTokens: 8 },
  defaultMaxTokens: 16,
  enqueuedAt: Date.now(),
  deadlineAt: Date.now() + 60_000,
};

const finish: EngineEvent = { type: 'finish', usage: { promptTokens: 3, completionTokens: 5 }, timings: { queueMs: 1, prefillMs: 1, firstTokenMs: 1 } } as EngineEvent;

describe('JobProcessor', () => {
  it('carries the tokens of deltas the detokenizer held back into the next delta, and to the end', async () => {
    const { processor, published, finished } = processorFor([
      { type: 'text-delta', index: 0, tokenIds: [10], text: 'a' },
      // Two tokens that are parts of one character: no text yet.
      { type: 'text-delta', index: 0, tokenIds: [11], text: '' },
      { type: 'text-delta', index: 0, tokenIds: [12], text: 'é' },
      // A trailing partial character the detokenizer never releases.
      { type: 'text-delta', index: 0, tokenIds: [13], text: '' },
      { type: 'text-delta', index: 0, tokenIds: [14], text: '' },
      { type: 'text-end', index: 0, finishReason: 'length' },
      finish,
    ]);
    await processor.process(job, 1);
    const deltas = published.filter((e) => e.type === 'text-delta');
    expect(deltas.map((e) => [e.text, e.tokens])).toEqual([
      ['a', 1],
      ['é', 2],
      ['', 2],
    ]);
    expect(deltas.reduce((sum, e) => sum + e.tokens, 0)).toBe(5);
    expect(published.map((e) => e.type)).toEqual(['accepted', 'text-delta', 'text-delta', 'text-delta', 'text-end', 'finish']);
    expect(finished).toEqual([{ finishReason: 'length', completionTokens: 5 }]);
  });
});
