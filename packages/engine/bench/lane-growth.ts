/**
 * The decode lane's growth alone, on the bench model's KV shape: 32 rows growing a slot per step
 * from a 20-token prompt to their reservation, buffers preallocated (warm pages). Prints the
 * capacities it grows to, the time spent in whole-lane re-layouts (total and longest) and the mean
 * capacity attended over (padding included), medians of ROUNDS runs.
 * Run: [LIMIT=790] [ROUNDS=5] [KV_GROWTH=in-place] node --import tsx packages/engine/bench/lane-growth.ts
 */
import { KvBatch, type KvShape } from '../src/kv-batch.js';
import { LaneKv } from '../src/kv-lane.js';
import type { KvGrowth } from '../src/types.js';
import { median } from './raw-session.js';

const shape: KvShape = { numLayers: 8, numKvHeads: 4, headDim: 64, dtype: 'float32' };
const rows = 32;
const prompt = 20;
const limit = Number(process.env.LIMIT ?? 790);
const rounds = Number(process.env.ROUNDS ?? 5);
const growth = (process.env.KV_GROWTH ?? 'in-place') as KvGrowth;
const tensors = shape.numLayers * 2;
const elements = (slots: number, count: number) => count * shape.numKvHeads * slots * shape.headDim;
const source = new KvBatch(
  shape,
  Array.from({ length: tensors }, () => new Float32Array(elements(prompt, 1)).fill(1)),
  [prompt],
  prompt,
).rowSource(0);
const slices = Array.from({ length: tensors }, () => new Float32Array(elements(1, rows)).fill(2));

const results = Array.from({ length: rounds }, () => {
  const lane = new LaneKv(shape, rows, growth);
  lane.preallocate(2048, rows * 2048);
  for (let row = 0; row < rows; row++) lane.addRow(source, limit);
  const capacities: number[] = [];
  let totalMs = 0;
  let longestMs = 0;
  let attended = 0;
  for (let length = prompt; length < limit; length++) {
    const before = lane.capacity;
    const started = performance.now();
    lane.reserveNext(limit);
    const ms = performance.now() - started;
    totalMs += ms;
    longestMs = Math.max(longestMs, ms);
    if (lane.capacity !== before) capacities.push(lane.capacity);
    attended += lane.capacity;
    lane.append(slices);
  }
  return { capacities, totalMs, longestMs, meanCapacity: attended / (limit - prompt) };
});
console.log(`${rows} rows, ${prompt} → ${limit} slots, ${growth} growth: capacities ${results[0]!.capacities.join(', ')}`);
console.log(
  `reserveNext total ${median(results.map((r) => r.totalMs)).toFixed(1)} ms, longest ${median(results.map((r) => r.longestMs)).toFixed(1)} ms, ` +
    `mean capacity ${results[0]!.meanCapacity.toFixed(1)} slots (medians of ${rounds} rounds)`,
);
