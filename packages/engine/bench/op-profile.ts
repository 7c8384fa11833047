/**
 * onnxruntime's own profiler over decode calls of a model as the engine runs it (graph rewritten,
 * new key/value slices fetched): kernel time summed per operator type, per call.
 * Run: BENCH_MODEL_DIR=<dir> PAST=512 ROWS=32 node --import tsx packages/engine/bench/op-profile.ts
 */
import { readdir, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import * as ort from 'onnxruntime-node';
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { rewriteDecoderGraph, rewrittenSessionConfig } from '../src/rewrite-decoder-graph.js';

const model = await loadModelDir(process.env.BENCH_MODEL_DIR ?? (await ensureBuiltinModel('bench')));
const rows = Number(process.env.ROWS ?? 32);
const past = Number(process.env.PAST ?? 512);
const calls = 10;
const rewritten = await rewriteDecoderGraph(model.onnxPath);
if (rewritten === undefined) throw new Error('the graph could not be rewritten');
const session = await ort.InferenceSession.create(rewritten.bytes, {
  enableProfiling: true,
  profileFilePrefix: join(tmpdir(), 'sluice-op-profile'),
  graphOptimizationLevel: 'all',
  extra: { session: rewrittenSessionConfig(rewritten) },
});
const { numLayers, numKvHeads, headDim } = model.io;
const feeds: Record<string, ort.Tensor> = {
  input_ids: new ort.Tensor('int64', new BigInt64Array(rows).fill(5n), [rows, 1]),
  attention_mask: new ort.Tensor('int64', new BigInt64Array(rows * (past + 1)).fill(1n), [rows, past + 1]),
  position_ids: new ort.Tensor('int64', new BigInt64Array(rows).fill(BigInt(past)), [rows, 1]),
};
const kvSize = rows * numKvHeads * past * headDim;
for (let i = 0; i < numLayers; i++) {
  for (const part of ['key', 'value']) {
    feeds[`past_key_values.${i}.${part}`] = new ort.Tensor('float32', new Float32Array(kvSize).fill(0.01), [
      rows,
      numKvHeads,
      past,
      headDim,
    ]);
  }
}
const fetches = ['logits', ...rewritten.newKvNames];
for (let i = 0; i < calls; i++) await session.run(feeds, fetches);
session.endProfiling();
const profiles = (await readdir(tmpdir())).filter((name) => name.startsWith('sluice-op-profile')).map((name) => join(tmpdir(), name));
const file = profiles.sort().at(-1);
if (file === undefined) throw new Error('onnxruntime wrote no profile');
const events = JSON.parse(await readFile(file, 'utf8')) as Array<{ cat: string; name: string; dur: number; args?: { op_name?: string } }>;
for (const path of profiles) await rm(path, { force: true });
const byOp = new Map<string, number>();
const byNode = new Map<string, number>();
let total = 0;
for (const event of events) {
  if (event.cat !== 'Node' || !event.name.endsWith('_kernel_time')) continue;
  const op = event.args?.op_name ?? '?';
  byOp.set(op, (byOp.get(op) ?? 0) + event.dur);
  // Nodes of every layer under one name.
  const node = `${op} ${event.name.replace(/_kernel_time$/, '').replace(/layers\.\d+/, 'layers.*')}`;
  byNode.set(node, (byNode.get(node) ?? 0) + event.dur);
  total += event.dur;
}
if (process.env.BY_NODE === '1') {
  for (const [node, us] of [...byNode].sort((a, b) => b[1] - a[1]).slice(0, 14))
    console.log(`  ${node.padEnd(70)} ${(us / calls / 1000).toFixed(2)} ms`);
}
console.log(`${model.dir}: batch ${rows}, past ${past}: ${(total / calls / 1000).toFixed(2)} ms of kernels per call`);
for (const [op, us] of [...byOp].sort((a, b) => b[1] - a[1]).slice(0, 10))
  console.log(`  ${op.padEnd(28)} ${(us / calls / 1000).toFixed(2)} ms`);
await session.release();
