/**
 * Focused microbenchmark: one decode step of 32 rows on the bench model at past 128, 256 and 512,
 * fetching every present.* (the model as exported) vs. logits + new key/value slices into an
 * engine-owned cache (LaneKv; the graph rewritten at load, present.* dropped). session.run only,
 * medians over interleaved rounds. BENCH_MODEL_DIR serves another model directory (e.g. a `gqa` export).
 * Run: node --import tsx packages/engine/bench/decode-step.ts
 */
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { OnnxSession } from '../src/onnx-session.js';
import { filledBatch, median, rawLaneSteps, rawPresentSteps } from './raw-session.js';

const model = await loadModelDir(
  process.env.BENCH_MODEL_DIR ?? (await ensureBuiltinModel((process.env.BENCH_MODEL ?? 'bench') as 'bench')),
);
const session = await OnnxSession.create({ modelPath: model.onnxPath, executionProvider: 'cpu', intraOpThreads: 0, interOpThreads: 0 });
const presentSession = await OnnxSession.create({
  modelPath: model.onnxPath,
  executionProvider: 'cpu',
  intraOpThreads: 0,
  interOpThreads: 0,
  newKvOutputs: false,
});
console.log(`new key/value outputs: ${session.outputsNewKv}`);
const rows = Number(process.env.ROWS ?? 32);
for (const past of [128, 256, 512]) {
  const old: number[] = [];
  const lane: number[] = [];
  for (let round = 0; round < 3; round++) {
    const start = filledBatch(session.io.kv, new Array<number>(rows).fill(past));
    old.push(...(await rawPresentSteps(presentSession, start, 5)).slice(1));
    lane.push(...(await rawLaneSteps(session, start, 5)).slice(1));
  }
  console.log(`batch ${rows} past ${past}: present.* fetched ${median(old).toFixed(1)} ms, new slices only ${median(lane).toFixed(1)} ms`);
}
await session.dispose();
await presentSession.dispose();
