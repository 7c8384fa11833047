import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { describe, expect, it } from 'vitest';
import { createEngine, type EngineOptions } from '../src/index.js';
import { KV_ALIGN } from '../src/kv-lane.js';

describe('createEngine options', () => {
  it.each([
    [{ kvPreallocate: 'yes' }, /EngineOptions\.kvPreallocate must be a boolean, got yes/],
    [{ weightsInPlace: 1 }, /EngineOptions\.weightsInPlace must be a boolean, got 1/],
    [{ earlyFirstTokens: 'no' }, /EngineOptions\.earlyFirstTokens must be true, false or 'after-prefills', got no/],
    [{ kvGrowth: 'sideways' }, /EngineOptions\.kvGrowth must be spread or in-place, got sideways/],
    [{ intraOpSpinning: 'after-run' }, /EngineOptions\.intraOpSpinning must be true, false or 'during-run', got after-run/],
    [{ maxBatchSize: 0 }, /maxBatchSize/],
    [{ maxPrefillBatch: 0 }, /EngineOptions\.maxPrefillBatch must be an integer ≥ 1, got 0/],
  ])('refuses %o before loading anything, naming the option', async (bad, message) => {
    const options = { modelDir: '/nonexistent', ...bad } as unknown as EngineOptions;
    await expect(createEngine(options)).rejects.toThrow(message);
  });

  it('with kvPreallocate, reserves maxCachedTokens slots of KV cache at start, and each row’s capacity alignment (twice with spread growth), and says how much', async () => {
    const modelDir = await ensureBuiltinModel('tiny');
    const { config } = await loadModelDir(modelDir);
    const slotBytes = (config.num_hidden_layers as number) * 2 * (config.num_key_value_heads as number) * (config.head_dim as number) * 4;
    for (const [kvGrowth, sets] of [
      ['in-place', 1],
      ['spread', 2],
    ] as const) {
      const engine = await createEngine({ modelDir, maxBatchSize: 4, maxCachedTokens: 1000, kvPreallocate: true, kvGrowth });
      try {
        // A row's capacity may pass its reservation by KV_ALIGN − 1 slots (kv-lane.ts): 4 rows × 15.
        expect(engine.info.kvReservedBytes).toBe(sets * (1000 + 4 * (KV_ALIGN - 1)) * slotBytes);
        const stream = engine.generate({
          id: `reserved-${kvGrowth}`,
          promptTokenIds: [5, 6, 7],
          sampling: { maxTokens: 4, ignoreEos: true },
        });
        let tokens = 0;
        for await (const event of stream) if (event.type === 'text-delta') tokens += event.tokenIds.length;
        expect(tokens).toBe(4);
      } finally {
        await engine.close();
      }
    }
  });

  it('with weightsInPlace, gives the same tokens and logprobs to the bit as with the weights read in (prefill and decode, two rows)', async () => {
    const modelDir = await ensureBuiltinModel('tiny');
    const answers: Array<{ tokens: number[]; logprobs: number[] }> = [];
    for (const weightsInPlace of [false, true]) {
      const engine = await createEngine({ modelDir, maxBatchSize: 2, weightsInPlace });
      try {
        const run = async (id: string, promptTokenIds: number[]) => {
          const answer = { tokens: [] as number[], logprobs: [] as number[] };
          const stream = engine.generate({
            id,
            promptTokenIds,
            sampling: { maxTokens: 12, temperature: 0, ignoreEos: true, logprobs: true },
          });
          for await (const event of stream) {
            if (event.type !== 'text-delta') continue;
            answer.tokens.push(...event.tokenIds);
            answer.logprobs.push(...(event.logprobs ?? []).map((entry) => entry.logprob));
          }
          return answer;
        };
        const both = await Promise.all([run(`a-${weightsInPlace}`, [5, 6, 7]), run(`b-${weightsInPlace}`, [9, 10, 11, 12, 13])]);
        for (const answer of both) expect(answer.logprobs).toHaveLength(12);
        answers.push(...both);
      } finally {
        await engine.close();
      }
    }
    expect(answers[2]).toEqual(answers[0]);
    expect(answers[3]).toEqual(answers[1]);
  });

  it('gives the same greedy tokens whether onnxruntime threads spin always, never or during a call', async () => {
    const modelDir = await ensureBuiltinModel('tiny');
    const answers: number[][] = [];
    for (const intraOpSpinning of [true, false, 'during-run'] as const) {
      const engine = await createEngine({ modelDir, maxBatchSize: 2, intraOpThreads: 2, intraOpSpinning });
      try {
        const tokens: number[] = [];
        const stream = engine.generate({
          id: `spin-${intraOpSpinning}`,
          promptTokenIds: [5, 6, 7],
          sampling: { maxTokens: 16, temperature: 0, ignoreEos: true },
        });
        for await (const event of stream) if (event.type === 'text-delta') tokens.push(...event.tokenIds);
        expect(tokens).toHaveLength(16);
        answers.push(tokens);
      } finally {
        await engine.close();
      }
    }
    expect(answers[1]).toEqual(answers[0]);
    expect(answers[2]).toEqual(answers[0]);
  });
});
