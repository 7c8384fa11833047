/**
 * Times one decode step of the built-in models with raw onnxruntime-node (not a test):
 *
 *   npx tsx packages/model/test/support/time-decode-step.ts [tiny|bench ...]
 *
 * For each preset, intra-op thread count and batch size it prefills a 32-token context, then runs
 * decode steps of one token per row, feeding present → past, and prints the median and p90 time of
 * `session.run` (inputs are built before the clock starts). Also prints how long generating the
 * preset takes. Timings on shared machines are noisy: compare numbers from one run only.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import * as ort from 'onnxruntime-node';
import { generateTinyModel } from '../../src/tiny-model/generate-tiny-model.js';
import type { TinyModelPreset } from '../../src/types.js';
import { RawOnnxModel } from './raw-greedy.js';

const CONTEXT = 32;
const STEPS = 60;
const WARMUP = 5;

function quantile(sorted: number[], q: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] as number;
}

const int64 = (values: number[], dims: number[]): ort.Tensor =>
  new ort.Tensor(
    'int64',
    BigInt64Array.from(values, (v) => BigInt(v)),
    dims,
  );

async function timeSteps(model: RawOnnxModel, batch: number): Promise<number[]> {
  const prompt = Array.from({ length: CONTEXT }, (_, i) => 300 + ((i * 37) % 700));
  const rows = Array.from({ length: batch }, () => prompt);
  let { present } = await model.forward(
    rows,
    rows.map(() => prompt.map(() => 1)),
    rows.map(() => prompt.map((_, i) => i)),
    model.emptyCache(batch),
  );
  const times: number[] = [];
  for (let step = 0; step < WARMUP + STEPS; step++) {
    const total = CONTEXT + step + 1;
    const feeds: Record<string, ort.Tensor> = {
      input_ids: int64(Array<number>(batch).fill(5 + step), [batch, 1]),
      attention_mask: int64(Array<number>(batch * total).fill(1), [batch, total]),
      position_ids: int64(Array<number>(batch).fill(total - 1), [batch, 1]),
    };
    for (let i = 0; i < model.numLayers; i++) {
      feeds[`past_key_values.${i}.key`] = present.get(`${i}.key`) as ort.Tensor;
      feeds[`past_key_values.${i}.value`] = present.get(`${i}.value`) as ort.Tensor;
    }
    const t0 = performance.now();
    const out = await model.session.run(feeds);
    if (step >= WARMUP) times.push(performance.now() - t0);
    present = new Map();
    for (let i = 0; i < model.numLayers; i++) {
      present.set(`${i}.key`, out[`present.${i}.key`] as ort.Tensor);
      present.set(`${i}.value`, out[`present.${i}.value`] as ort.Tensor);
    }
  }
  return times.sort((a, b) => a - b);
}

async function timePreset(preset: TinyModelPreset): Promise<void> {
  const dir = await mkdtemp(join(tmpdir(), `sluice-time-${preset}-`));
  try {
    const started = performance.now();
    await generateTinyModel({ preset, outDir: dir });
    console.log(`${preset}: generated in ${((performance.now() - started) / 1000).toFixed(2)} s`);
    for (const threads of [1, 2]) {
      const model = await RawOnnxModel.load(dir, { intraOpNumThreads: threads });
      for (const batch of [1, 32]) {
        const times = await timeSteps(model, batch);
        console.log(
          `${preset}: batch ${String(batch).padStart(2)}, ${threads} intra-op thread(s): session.run median ` +
            `${quantile(times, 0.5).toFixed(3)} ms, p90 ${quantile(times, 0.9).toFixed(3)} ms`,
        );
      }
      await model.release();
    }
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

const presets = (process.argv.length > 2 ? process.argv.slice(2) : ['tiny', 'bench']) as TinyModelPreset[];
for (const preset of presets) await timePreset(preset);
