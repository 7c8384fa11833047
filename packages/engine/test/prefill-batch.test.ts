import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createEngine, type Engine, type GenerateRequest, type StepStats } from '../src/index.js';
import { packPrompts } from '../src/pack-inputs.js';
import { collect } from './support/collect.js';
import { withLogitsToKeep } from './support/logits-to-keep.js';
import { tinyModelDir } from './support/model-forms.js';

/**
 * `maxPrefillBatch`: whole prompts that arrive together are prefilled in one call (right-padded to the
 * longest of the call), and each request still gets the tokens and logprobs, to the bit, it gets alone.
 */

/** Prompts of several lengths (short ones pad each other; 30 and 31 are chunked past the step budget). */
const LENGTHS = [3, 3, 4, 7, 8, 9, 15, 16, 30, 31];

function requests(): GenerateRequest[] {
  return LENGTHS.map((length, i) => ({
    id: `prompt-${i}`,
    promptTokenIds: Array.from({ length }, (_, t) => 3 + ((i * 131 + t * 17) % 1000)),
    sampling:
      i % 3 === 2
        ? { maxTokens: 12, ignoreEos: true, temperature: 0.8, topP: 0.9, seed: 1000 + i, n: 2 }
        : { maxTokens: 12, ignoreEos: true, temperature: 0, logprobs: true },
  }));
}

async function runTogether(engine: Engine, batch: GenerateRequest[]) {
  const steps: StepStats[] = [];
  const off = engine.onStep((stats) => steps.push(stats));
  const results = await Promise.all(batch.map((request) => collect(engine.generate(request))));
  off();
  return { results, steps };
}

describe('prompts prefilled together (maxPrefillBatch)', () => {
  it('packs the prompts of one call right-padded: each row’s tokens first, then masked padding', () => {
    const inputs = packPrompts([[9, 8, 7], [6]], 0);
    expect(inputs).toMatchObject({ rows: 2, pastLength: 0, newTokens: 3 });
    expect(Array.from(inputs.inputIds, Number)).toEqual([9, 8, 7, 6, 0, 0]);
    expect(Array.from(inputs.attentionMask, Number)).toEqual([1, 1, 1, 1, 0, 0]);
    expect(Array.from(inputs.positionIds, Number)).toEqual([0, 1, 2, 0, 1, 2]);
  });

  const made: Array<{ remove: () => Promise<void> }> = [];
  let plainDir: string;
  let gqaDir: string;
  let alone: Engine;
  let together: Engine;
  let gqaTogether: Engine;
  let decomposedAlone: Engine;
  let decomposedTogether: Engine;
  let keepAlone: Engine;
  let keepTogether: Engine;

  beforeAll(async () => {
    const plain = await tinyModelDir('plain');
    const gqa = await tinyModelDir('gqa');
    const keep = await withLogitsToKeep(plain.dir);
    made.push(plain, gqa, keep);
    plainDir = plain.dir;
    gqaDir = gqa.dir;
    const options = { maxBatchSize: 16, maxStepTokens: 40, intraOpThreads: 1 };
    [alone, together, gqaTogether, decomposedAlone, decomposedTogether] = await Promise.all([
      createEngine({ modelDir: plainDir, ...options, maxPrefillBatch: 1 }),
      createEngine({ modelDir: plainDir, ...options, maxPrefillBatch: 8 }),
      createEngine({ modelDir: gqaDir, ...options, maxPrefillBatch: 8, gqaAttention: 'op' }),
      createEngine({ modelDir: gqaDir, ...options, maxPrefillBatch: 1, gqaAttention: 'decomposed' }),
      createEngine({ modelDir: gqaDir, ...options, maxPrefillBatch: 8, gqaAttention: 'decomposed' }),
    ]);
    [keepAlone, keepTogether] = await Promise.all([
      createEngine({ modelDir: keep.dir, ...options, maxPrefillBatch: 1 }),
      createEngine({ modelDir: keep.dir, ...options, maxPrefillBatch: 8 }),
    ]);
  });

  afterAll(async () => {
    await Promise.all(
      [alone, together, gqaTogether, decomposedAlone, decomposedTogether, keepAlone, keepTogether].map((engine) => engine?.close()),
    );
    for (const entry of made) await entry.remove();
  });

  it.each([
    ['plain', () => [alone, together] as const],
    ['GroupQueryAttention decomposed into the plain form’s ops', () => [decomposedAlone, decomposedTogether] as const],
    // The engine then asks for every new position's logits and picks each row's last real one itself.
    ['an export keeping its last num_logits_to_keep positions (Optimum’s)', () => [keepAlone, keepTogether] as const],
  ])('gives each prompt prefilled with others in one padded call the tokens, text and logprobs it gets alone (%s)', async (_, engines) => {
    const [one, many] = engines();
    const batch = requests();
    const reference = [];
    for (const request of batch) reference.push(await collect(one.generate(request)));

    const { results, steps } = await runTogether(many, batch);
    for (const [i, request] of batch.entries()) {
      const got = results[i]!;
      const want = reference[i]!;
      expect(got.tokens, request.id).toEqual(want.tokens);
      expect(got.texts, request.id).toEqual(want.texts);
      expect(got.endReasons, request.id).toEqual(want.endReasons);
      if (request.sampling.logprobs === true) {
        // Right-padded, each row's keys sit at the indices they have alone: the softmax sums them in the same order.
        expect(got.logprobs, request.id).toEqual(want.logprobs);
      }
    }
    // Fewer prefill calls than prompt chunks.
    const calls = steps.reduce((sum, stats) => sum + stats.prefillCalls, 0);
    const chunks = steps.reduce((sum, stats) => sum + stats.promptChunks, 0);
    expect(chunks).toBeGreaterThanOrEqual(LENGTHS.length);
    expect(calls).toBeLessThan(chunks);
    expect(steps.at(-1)?.cachedTokens).toBe(0);
  });

  it('prefills GroupQueryAttention graphs one prompt a call (they cannot express padding)', async () => {
    const batch = requests().filter((request) => request.promptTokenIds.length < 20);
    const { results, steps } = await runTogether(gqaTogether, batch);
    expect(results.every((result) => result.endReasons.every((reason) => reason === 'length'))).toBe(true);
    const calls = steps.reduce((sum, stats) => sum + stats.prefillCalls, 0);
    const chunks = steps.reduce((sum, stats) => sum + stats.promptChunks, 0);
    expect(chunks).toBeGreaterThanOrEqual(batch.length);
    expect(calls).toBe(chunks);
  });
});
