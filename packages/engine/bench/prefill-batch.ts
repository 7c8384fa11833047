/**
 * What prefilling several prompts in one call would save: one prefill call of ROWS prompts of LENGTH
 * tokens each (no past, the graph rewritten as the engine loads it), for each ROWS of BATCHES, plus
 * one prompt of the same total length; medians of ROUNDS rounds of 4 calls. The engine prefills one
 * prompt per call (docs/engine.md, "A step"), so a burst's prompts each read all the weights.
 * Run: PRESET=smollm2-135m BATCHES=1,2,4,8,32 LENGTH=17 node --import tsx packages/engine/bench/prefill-batch.ts
 */
import * as ort from 'onnxruntime-node';
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { rewriteDecoderGraph } from '../src/rewrite-decoder-graph.js';

const preset = (process.env.PRESET ?? 'bench') as 'bench';
const model = await loadModelDir(await ensureBuiltinModel(preset));
const rewritten = await rewriteDecoderGraph(model.onnxPath);
if (rewritten === undefined) throw new Error('the graph has no pattern the engine rewrites');
const session = await ort.InferenceSession.create(rewritten.bytes, { graphOptimizationLevel: 'all', logSeverityLevel: 3 });
const fetches = ['logits', ...rewritten.newKvNames];
const length = Number(process.env.LENGTH ?? 17);
const batches = (process.env.BATCHES ?? '1,2,4,8,32').split(',').map(Number);
const rounds = Number(process.env.ROUNDS ?? 3);
const { numLayers, numKvHeads, headDim } = model.io;

function feeds(rows: number, tokens: number): Record<string, ort.Tensor> {
  const out: Record<string, ort.Tensor> = {
    input_ids: new ort.Tensor(
      'int64',
      BigInt64Array.from({ length: rows * tokens }, (_, i) => BigInt(5 + (i % 1000))),
      [rows, tokens],
    ),
    attention_mask: new ort.Tensor('int64', new BigInt64Array(rows * tokens).fill(1n), [rows, tokens]),
    position_ids: new ort.Tensor(
      'int64',
      BigInt64Array.from({ length: rows * tokens }, (_, i) => BigInt(i % tokens)),
      [rows, tokens],
    ),
  };
  for (let layer = 0; layer < numLayers; layer++)
    for (const part of ['key', 'value'])
      out[`past_key_values.${layer}.${part}`] = new ort.Tensor('float32', new Float32Array(0), [rows, numKvHeads, 0, headDim]);
  return out;
}

const shapes: Array<[rows: number, tokens: number]> = [...batches.map((rows): [number, number] => [rows, length])];
const longest = Math.max(...batches);
if (longest > 1) shapes.push([1, longest * length]);
const inputs = shapes.map(([rows, tokens]) => feeds(rows, tokens));
const times = shapes.map(() => [] as number[]);
for (let round = 0; round < rounds; round++) {
  for (const [k] of shapes.entries()) {
    await session.run(inputs[k]!, fetches);
    for (let call = 0; call < 4; call++) {
      const start = performance.now();
      await session.run(inputs[k]!, fetches);
      times[k]!.push(performance.now() - start);
    }
  }
}
const med = (a: readonly number[]) => [...a].sort((x, y) => x - y)[a.length >> 1]!;
console.log(`${preset}: prefill calls, medians of ${rounds * 4}`);
for (const [k, [rows, tokens]] of shapes.entries()) {
  const ms = med(times[k]!);
  console.log(`${rows} × ${tokens} tokens: ${ms.toFixed(1)} ms${rows > 1 ? ` (${(ms / rows).toFixed(1)} ms per prompt)` : ''}`);
}
await session.release();
