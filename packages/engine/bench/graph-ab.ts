/**
 * Two model directories (e.g. a graph before and after a generator change) on issue 12's workloads,
 * side by side in one run: rounds alternate between the two engines, so machine noise hits both.
 * Run: BASELINE_DIR=<dir> [CANDIDATE_DIR=<dir>] [ROUNDS=3] node --import tsx packages/engine/bench/graph-ab.ts
 */
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { createEngine } from '../src/index.js';
import { median } from './raw-session.js';
import { runPeerWorkloads, type WorkloadResult } from './peer-workloads.js';

const baselineDir = process.env.BASELINE_DIR;
if (baselineDir === undefined) throw new Error('BASELINE_DIR: the model directory to compare against');
const candidateDir = process.env.CANDIDATE_DIR ?? (await ensureBuiltinModel('bench'));
const rounds = Number(process.env.ROUNDS ?? 3);
const sides = [
  { name: 'baseline', dir: baselineDir },
  { name: 'candidate', dir: candidateDir },
];
const engines = await Promise.all(sides.map(({ dir }) => createEngine({ modelDir: dir, maxBatchSize: 32, maxStepTokens: 512 })));
const vocab = (await loadModelDir(candidateDir)).tokenizer.vocabSize;
const results = sides.map(() => [] as WorkloadResult[][]);
for (let round = 0; round < rounds; round++) {
  for (const [i, engine] of engines.entries()) {
    results[i]!.push(
      await runPeerWorkloads(engine, vocab, 1, (line) => console.log(`${sides[i]!.name.padEnd(9)} ${round + 1}/${rounds}: ${line}`)),
    );
  }
}
console.log(
  '\n| workload | side | tokens/s (median of rounds) | step p50 (ms) | step p99 (ms) | ITL p99 (ms) |\n|---|---|---:|---:|---:|---:|',
);
for (const name of ['32x128', '32x768', '1x128']) {
  for (const [i, side] of sides.entries()) {
    const runs = results[i]!.map((r) => r.find((w) => w.name === name)!);
    console.log(
      `| ${name} | ${side.name} | ${median(runs.map((r) => r.tokensPerSecond)).toFixed(1)} | ${median(runs.map((r) => r.stepP50Ms)).toFixed(1)} | ${median(runs.map((r) => r.stepP99Ms)).toFixed(1)} | ${median(runs.map((r) => r.itlP99Ms)).toFixed(1)} |`,
    );
  }
}
await Promise.all(engines.map((engine) => engine.close()));
