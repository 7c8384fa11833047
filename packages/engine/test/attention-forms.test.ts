import { loadModelDir, type ModelDir } from '@sluice/model';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { RawOnnxModel } from '../../model/test/support/raw-greedy.js';
import { EngineCore } from '../src/engine-core.js';
import { KvBatch } from '../src/kv-batch.js';
import { KV_BLOCK } from '../src/kv-lane.js';
import { packInputs } from '../src/pack-inputs.js';
import { OnnxSession } from '../src/onnx-session.js';
import { resolveRequest } from '../src/resolve-request.js';
import { MODEL_FORMS, tinyModelDir, usesGroupQueryAttention } from './support/model-forms.js';

/**
 * Real exports come in these forms: Optimum's plain operators, and onnxruntime's GroupQueryAttention
 * with rotary before it or inside it (q/k/v packed, no `position_ids` input: onnxruntime-genai's CPU
 * exports), each with its weights inside `model.onnx` or in a `model.onnx_data` file beside it (every
 * export past protobuf's 2 GB, and smaller ones); the generator writes all six. The GroupQueryAttention
 * forms also run with the operator replaced by the plain form's ops (`gqaAttention: 'decomposed'`). For each, the engine rewrites
 * the graph at load to return only the
 * step's new keys/values and serves the decode rows from its own cache; each request must get the
 * tokens of the plainest possible decoder (raw onnxruntime, one request alone, present.* fed back
 * as past) while rows join, leave and the lane grows past several capacity blocks.
 */
describe.each(MODEL_FORMS)('the $label form', (form) => {
  let model: ModelDir;
  let session: OnnxSession;
  let raw: RawOnnxModel;
  let remove: () => Promise<void>;

  beforeAll(async () => {
    const made = await tinyModelDir(form);
    remove = made.remove;
    model = await loadModelDir(made.dir);
    session = await OnnxSession.create({
      modelPath: model.onnxPath,
      executionProvider: 'cpu',
      intraOpThreads: 1,
      interOpThreads: 0,
      gqaAttention: form.gqaAttention ?? 'op',
    });
    raw = await RawOnnxModel.load(made.dir);
  });

  afterAll(async () => {
    await session?.dispose();
    await raw?.release();
    await remove?.();
  });

  it('is served from the engine-owned cache (new key/value slices, no present.* fetched)', () => {
    expect(model.io.usesGroupQueryAttention).toBe(usesGroupQueryAttention(form.attention));
    expect(model.onnxDataPaths).toHaveLength(form.externalData ? 1 : 0);
    expect(session.outputsNewKv).toBe(true);
    // Optimum's attention over present.* is split in every layer (the tiny model has 2).
    expect(session.splitAttentionLayers).toBe(form.attention === 'sdpa' ? 2 : 0);
  });

  it('returns the logits of the last position only, also for a prefill chunk', async () => {
    const past = KvBatch.empty(session.io.kv, 1);
    const output = await session.runNewKv(packInputs(0, [{ cachedLength: 0, tokens: [5, 6, 7, 8, 9] }], 0), past);
    expect(output.positions).toBe(1);
    expect(output.logits.length).toBe(model.tokenizer.vocabSize);
    expect(output.newKv[0]!.length).toBe(session.io.kv.numKvHeads * 5 * session.io.kv.headDim);
  });

  it.each([
    ['spread', false],
    ['in-place', false],
    ['in-place', true],
    ['spread', true],
  ] as const)(
    'gives every request the raw greedy loop’s tokens as rows join, leave and grow past several capacity blocks (%s growth, cache preallocated: %s)',
    async (kvGrowth, kvPreallocate) => {
      // Chunked prefill (24-token budget) beside decoding rows; rows of very different lengths share
      // the lane; the longest grows past 5 blocks.
      const core = new EngineCore(session, model, {
        maxBatchSize: 4,
        maxStepTokens: 24,
        maxCachedTokens: 4 * 2048,
        laneCost: 64,
        exactLengthBatches: false,
        continuationMode: 'replay',
        kvGrowth,
        kvPreallocate,
        maxPrefillBatch: 1,
        earlyFirstTokens: true,
      });
      const cases = [
        { prompt: 5, maxTokens: 5 * KV_BLOCK + 10 },
        { prompt: 40, maxTokens: 30 },
        { prompt: 3, maxTokens: 2 * KV_BLOCK + 7 },
        { prompt: 61, maxTokens: 90 },
        { prompt: 17, maxTokens: 3 * KV_BLOCK },
        { prompt: 9, maxTokens: 12 },
      ].map(({ prompt, maxTokens }, key) => ({
        key,
        maxTokens,
        promptTokenIds: Array.from({ length: prompt }, (_, t) => 3 + ((key * 131 + t * 17) % 1000)),
      }));
      const got: number[][] = cases.map(() => []);
      let maxRows = 0;
      let relayouts = 0;
      for (let step = 0; !core.idle || step <= 25 * cases.length; step++) {
        if (step % 25 === 0 && step / 25 < cases.length) {
          const c = cases[step / 25]!;
          core.add(
            c.key,
            resolveRequest(
              {
                id: `form-${c.key}`,
                promptTokenIds: c.promptTokenIds,
                sampling: { maxTokens: c.maxTokens, temperature: 0, ignoreEos: true },
              },
              { vocabSize: model.tokenizer.vocabSize, maxContextLength: 2048, maxBatchSize: 4, maxCachedTokens: 4 * 2048 },
            ),
            performance.timeOrigin + performance.now(),
          );
        }
        const { events, stats } = await core.step();
        maxRows = Math.max(maxRows, stats?.batchSize ?? 0);
        relayouts += stats?.kvRelayouts ?? 0;
        for (const [key, event] of events) {
          if (event.type === 'text-delta') got[key]!.push(...event.tokenIds);
          if (event.type === 'finish') expect(event.error, `request ${key}`).toBeUndefined();
        }
      }
      expect(maxRows).toBeGreaterThanOrEqual(3);
      // Growing in place copies the whole lane inside a step, and the step says so.
      if (kvGrowth === 'in-place') expect(relayouts).toBeGreaterThan(0);
      for (const c of cases) {
        const [want] = await raw.greedy([c.promptTokenIds], { maxNewTokens: c.maxTokens });
        expect(got[c.key], `request ${c.key}`).toEqual(want);
      }
    },
  );
});
