/**
 * Would a float16 KV cache (llama.cpp's default) pay on this CPU? One decode call (ROWS rows at each
 * past length of PASTS), the graph rewritten as the engine loads it, side by side with the same graph
 * taking its past as float16 and returning its new key/value slices as float16:
 * - plain form: a Cast to float32 after each past input (onnxruntime's CPU MatMul and Softmax are
 *   float32 only), and a Cast to float16 of each new slice;
 * - GroupQueryAttention form: the op reads the float16 past itself (onnxruntime registers a float16
 *   CPU kernel); its query/key/value inputs are cast to float16 and its output back to float32.
 * 10 calls per side per round, sides in turn, ROUNDS rounds; prints medians and the ratio.
 * Run: ROWS=32 PASTS=128,640 ROUNDS=5 node --import tsx packages/engine/bench/kv-dtype-ab.ts
 *      (MODEL_DIR=<dir> for another model, e.g. `npm run model:generate -- --preset bench --attention gqa --out <dir>`)
 */
import * as ort from 'onnxruntime-node';
import onnxProto from 'onnx-proto';
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { physicalCores } from '../src/physical-cores.js';
import { rewriteDecoderGraph, rewrittenSessionConfig } from '../src/rewrite-decoder-graph.js';
import { decodeFeeds } from './decode-feeds.js';
import { median } from './raw-session.js';

const { onnx } = onnxProto;
const { FLOAT, FLOAT16 } = onnx.TensorProto.DataType;
const model = await loadModelDir(process.env.MODEL_DIR ?? (await ensureBuiltinModel('bench')));
const rows = Number(process.env.ROWS ?? 32);
const pasts = (process.env.PASTS ?? '128,640').split(',').map(Number);
const rounds = Number(process.env.ROUNDS ?? 5);
const rewritten = await rewriteDecoderGraph(model.onnxPath);
if (rewritten === undefined) throw new Error('the graph has no pattern the engine rewrites');

const cast = (input: string, output: string, to: number) =>
  onnx.NodeProto.create({
    name: `${output}/Cast`,
    opType: 'Cast',
    input: [input],
    output: [output],
    attribute: [{ name: 'to', type: onnx.AttributeProto.AttributeType.INT, i: to }],
  });

/** The rewritten graph with a float16 past and float16 new slices (see the header). */
function withFloat16Cache(bytes: Uint8Array, newKvNames: readonly string[]): Uint8Array {
  const m = onnx.ModelProto.decode(bytes);
  const graph = m.graph!;
  const nodes = graph.node ?? [];
  const added: onnxProto.onnx.NodeProto[] = [];
  for (const input of graph.input ?? []) {
    if (!(input.name ?? '').startsWith('past_key_values.')) continue;
    input.type!.tensorType!.elemType = FLOAT16;
    const readers = nodes.filter((node) => (node.input ?? []).includes(input.name!));
    if (readers.every((node) => node.opType === 'GroupQueryAttention')) continue;
    const f32 = `${input.name}/float32`;
    for (const node of readers) node.input = (node.input ?? []).map((name) => (name === input.name ? f32 : name));
    added.push(cast(input.name!, f32, FLOAT));
  }
  for (const node of nodes) {
    if (node.opType !== 'GroupQueryAttention') continue;
    const inputs = [...(node.input ?? [])];
    for (const i of [0, 1, 2]) {
      added.push(cast(inputs[i]!, `${inputs[i]}/float16`, FLOAT16));
      inputs[i] = `${inputs[i]}/float16`;
    }
    node.input = inputs;
    const output = node.output![0]!;
    node.output![0] = `${output}/float16`;
    added.push(cast(`${output}/float16`, output, FLOAT));
  }
  for (const output of graph.output ?? []) {
    if (!newKvNames.includes(output.name ?? '')) continue;
    added.push(cast(output.name!, `${output.name}/float16`, FLOAT16));
    output.name = `${output.name}/float16`;
    output.type = { tensorType: { elemType: FLOAT16 } };
  }
  graph.node = [...added, ...nodes];
  return onnx.ModelProto.encode(m).finish();
}

// The engine's thread count (one intra-op thread per physical core), whatever onnxruntime would pick.
const options: ort.InferenceSession.SessionOptions = {
  graphOptimizationLevel: 'all',
  logSeverityLevel: 3,
  intraOpNumThreads: physicalCores(),
  extra: { session: rewrittenSessionConfig(rewritten) },
};
const sides = [
  { name: 'float32 cache', session: await ort.InferenceSession.create(rewritten.bytes, options), half: false },
  {
    name: 'float16 cache',
    session: await ort.InferenceSession.create(withFloat16Cache(rewritten.bytes, rewritten.newKvNames), options),
    half: true,
  },
];
console.log(`${model.onnxPath}: ${rows} rows, onnxruntime-node ${ort.env.versions.common}`);
for (const past of pasts) {
  const inputs = sides.map((side) => decodeFeeds(model.io, { rows, past, half: side.half }));
  const times = sides.map(() => [] as number[]);
  for (let round = 0; round < rounds; round++) {
    for (const [k, side] of sides.entries()) {
      await side.session.run(inputs[k]!);
      for (let call = 0; call < 10; call++) {
        const start = performance.now();
        await side.session.run(inputs[k]!);
        times[k]!.push(performance.now() - start);
      }
    }
  }
  const [f32, f16] = times.map(median) as [number, number];
  console.log(`past ${past}: float32 ${f32.toFixed(2)} ms, float16 ${f16.toFixed(2)} ms, float16 ÷ float32 ${(f16 / f32).toFixed(3)}`);
}
for (const side of sides) await side.session.release();
