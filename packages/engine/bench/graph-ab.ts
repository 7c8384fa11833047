/**
 * Two engines on issue 12's workloads, side by side in one run: two model directories (e.g. a graph
 * before and after a generator change) and/or two sets of engine options; rounds alternate between
 * the two engines, so machine noise hits both.
 * Run: [BASELINE_DIR=<dir>] [CANDIDATE_DIR=<dir>] [BASELINE_OPTIONS='{"kvGrowth":"in-place"}']
 *      [CANDIDATE_OPTIONS=<json>] [ROUNDS=3] [WORKLOADS=32x768,...] node --import tsx packages/engine/bench/graph-ab.ts
 * (a directory left out is the built-in bench model).
 */
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { createEngine, type EngineOptions } from '../src/index.js';
import { median } from './raw-session.js';
import { PEER_WORKLOADS, runPeerWorkloads, type WorkloadResult } from './peer-workloads.js';

const bench = await ensureBuiltinModel('bench');
const options = (name: string): Partial<EngineOptions> => JSON.parse(process.env[name] ?? '{}') as Partial<EngineOptions>;
const sides = [
  { name: 'baseline', dir: process.env.BASELINE_DIR ?? bench, options: options('BASELINE_OPTIONS') },
  { name: 'candidate', dir: process.env.CANDIDATE_DIR ?? bench, options: options('CANDIDATE_OPTIONS') },
];
if (sides[0]!.dir === sides[1]!.dir && JSON.stringify(sides[0]!.options) === JSON.stringify(sides[1]!.options)) {
  throw new Error('The two sides are the same: set BASELINE_DIR/CANDIDATE_DIR or BASELINE_OPTIONS/CANDIDATE_OPTIONS.');
}
const rounds = Number(process.env.ROUNDS ?? 3);
const names = process.env.WORKLOADS?.split(',');
const workloads = PEER_WORKLOADS.filter((workload) => names === undefined || names.includes(workload.name));
for (const side of sides) console.log(`${side.name}: ${side.dir} ${JSON.stringify(side.options)}`);
const engines = await Promise.all(
  sides.map(({ dir, options }) => createEngine({ modelDir: dir, maxBatchSize: 32, maxStepTokens: 512, ...options })),
);
const vocab = (await loadModelDir(sides[1]!.dir)).tokenizer.vocabSize;
const results = sides.map(() => [] as WorkloadResult[][]);
for (let round = 0; round < rounds; round++) {
  // Each side goes first in every other round.
  for (const i of round % 2 === 0 ? [0, 1] : [1, 0]) {
    results[i]!.push(
      await runPeerWorkloads(
        engines[i]!,
        vocab,
        1,
        (line) => console.log(`${sides[i]!.name.padEnd(9)} ${round + 1}/${rounds}: ${line}`),
        workloads,
      ),
    );
  }
}
console.log(
  '\n| workload | side | tokens/s (median of rounds) | step p50 (ms) | step p99 (ms) | ITL p99 (ms) |\n|---|---|---:|---:|---:|---:|',
);
for (const { name } of workloads) {
  for (const [i, side] of sides.entries()) {
    const runs = results[i]!.map((r) => r.find((w) => w.name === name)!);
    console.log(
      `| ${name} | ${side.name} | ${median(runs.map((r) => r.tokensPerSecond)).toFixed(1)} | ${median(runs.map((r) => r.stepP50Ms)).toFixed(1)} | ${median(runs.map((r) => r.stepP99Ms)).toFixed(1)} | ${median(runs.map((r) => r.itlP99Ms)).toFixed(1)} |`,
    );
  }
}
await Promise.all(engines.map((engine) => engine.close()));
