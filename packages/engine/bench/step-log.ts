/**
 * Every step over OVER_MS of issue 12's workloads (and the first four of each round), with its phase,
 * rows, model time and re-layouts, to see what sets the ITL p99; engine options from ENGINE_OPTIONS.
 * Run: [ROUNDS=3] [OVER_MS=30] [WORKLOADS=32x128,32x768] [ENGINE_OPTIONS='{"kvPreallocate":true}']
 *      node --import tsx packages/engine/bench/step-log.ts
 */
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { createEngine } from '../src/index.js';
import { PEER_WORKLOADS, runPeerWorkloads } from './peer-workloads.js';

const dir = process.env.BENCH_MODEL_DIR ?? (await ensureBuiltinModel('bench'));
const rounds = Number(process.env.ROUNDS ?? 3);
const over = Number(process.env.OVER_MS ?? 30);
const names = (process.env.WORKLOADS ?? '32x128').split(',');
const engine = await createEngine({
  modelDir: dir,
  maxBatchSize: 32,
  maxStepTokens: 512,
  ...(JSON.parse(process.env.ENGINE_OPTIONS ?? '{}') as object),
});
console.log(
  `engine ready ${(performance.now() / 1000).toFixed(1)} s after start, rss ${(process.memoryUsage().rss / 2 ** 20).toFixed(0)} MiB`,
);
const vocab = (await loadModelDir(dir)).tokenizer.vocabSize;
let index = 0;
engine.onStep((s) => {
  index++;
  if (s.stepMs >= over || index <= 4) {
    console.log(
      `step ${index}: ${s.phase} rows ${s.batchSize} tokens ${s.stepTokens} step ${s.stepMs.toFixed(1)} model ${s.modelMs.toFixed(1)} relayouts ${s.kvRelayouts} cached ${s.cachedTokens} lag ${s.eventLoopLagMs?.toFixed(1)}`,
    );
  }
});
for (let round = 0; round < rounds; round++) {
  index = 0;
  await runPeerWorkloads(
    engine,
    vocab,
    1,
    (line) => console.log(`round ${round + 1}: ${line}`),
    PEER_WORKLOADS.filter((w) => names.includes(w.name)),
  );
}
await engine.close();
