/**
 * One layer's attention scores of a batch-32 decode step (S = 1), written three ways, each as a
 * graph of its own, timed side by side in rounds (docs/engine.md, "Scores with alpha 1"):
 *
 * - `K·qT`: keys as the A operand times the group's queries as columns (generator version 6), the
 *   small result transposed back;
 * - `q·KT alpha`: per query head, keys transposed, the scale next to the MatMul (onnxruntime folds it
 *   into the product's alpha);
 * - `q·KT`: the same with the scale after a Reshape (alpha 1: MLAS's one-row kernel; version 7).
 *
 * Run: SLOTS=768 node --import tsx packages/engine/bench/scores-forms.ts
 */
import * as ort from 'onnxruntime-node';
import { OnnxGraphBuilder } from '../../model/src/tiny-model/onnx-graph-builder.js';
import { median } from './raw-session.js';

const rows = 32;
const kvHeads = 4;
const rep = 2;
const headDim = 64;
const slots = Number(process.env.SLOTS ?? 768);
const runs = 50;
const scale = 1 / Math.sqrt(headDim);

function graph(form: 'K·qT' | 'q·KT alpha' | 'q·KT'): Uint8Array {
  const g = new OnnxGraphBuilder(form);
  const keys = g.input('keys', 'float32', [rows, kvHeads, slots, headDim]);
  const queries = g.input('queries', 'float32', [rows, kvHeads, rep, 1, headDim]);
  let scores: string;
  if (form === 'K·qT') {
    const columns = g.op('Transpose', [g.op('Reshape', [queries, g.int64([0, kvHeads, -1, headDim])])], { perm: { ints: [0, 1, 3, 2] } });
    scores = g.op('Transpose', [g.op('Mul', [g.op('MatMul', [keys, columns]), g.float32([scale], [])])], { perm: { ints: [0, 1, 3, 2] } });
  } else {
    const keysT = g.op('Transpose', [g.op('Unsqueeze', [keys, g.int64([2])])], { perm: { ints: [0, 1, 2, 4, 3] } });
    const product = g.op('MatMul', [queries, keysT]);
    scores =
      form === 'q·KT alpha'
        ? g.op('Reshape', [g.op('Mul', [product, g.float32([scale], [])]), g.int64([0, kvHeads, rep, slots])])
        : g.op('Mul', [g.op('Reshape', [product, g.int64([0, kvHeads, rep, slots])]), g.float32([scale], [])]);
  }
  g.output(scores, 'scores', 'float32', [rows, kvHeads, rep, slots]);
  return g.toBytes({ producerName: 'scores-forms', producerVersion: '1' });
}

const forms = ['K·qT', 'q·KT alpha', 'q·KT'] as const;
const sessions = await Promise.all(forms.map((form) => ort.InferenceSession.create(graph(form))));
const feeds = {
  keys: new ort.Tensor('float32', Float32Array.from({ length: rows * kvHeads * slots * headDim }, Math.random), [
    rows,
    kvHeads,
    slots,
    headDim,
  ]),
  queries: new ort.Tensor('float32', Float32Array.from({ length: rows * kvHeads * rep * headDim }, Math.random), [
    rows,
    kvHeads,
    rep,
    1,
    headDim,
  ]),
};
const times = forms.map(() => [] as number[]);
const outputs: Float32Array[] = [];
for (let round = 0; round < 4; round++) {
  for (const [i, session] of sessions.entries()) {
    const start = performance.now();
    for (let run = 0; run < runs; run++) outputs[i] = (await session.run(feeds)).scores!.data as Float32Array;
    times[i]!.push((performance.now() - start) / runs);
  }
}
console.log(`batch ${rows}, ${kvHeads} KV heads × ${rep}, ${slots} slots: ms per call (session.run, ${runs} calls a round)`);
for (const [i, form] of forms.entries()) {
  console.log(`  ${form.padEnd(11)} median ${median(times[i]!).toFixed(3)}, rounds ${times[i]!.map((t) => t.toFixed(3)).join(' / ')}`);
}
let maxDiff = 0;
for (let j = 0; j < outputs[0]!.length; j++) maxDiff = Math.max(maxDiff, Math.abs(outputs[0]![j]! - outputs[2]![j]!));
console.log(`  max |K·qT − q·KT| ${maxDiff.toExponential(2)}`);
await Promise.all(sessions.map((session) => session.release()));
