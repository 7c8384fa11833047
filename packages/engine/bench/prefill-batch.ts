/**
 * What prefilling several prompts in one call saves: one prefill call of ROWS prompts of LENGTH tokens
 * each (no past, the graph rewritten as the engine loads it), for each ROWS of BATCHES, plus one
 * prompt of the same total length; medians of ROUNDS rounds of 4 calls. A prompt prefilled alone
 * reads all the weights for a few tokens (why `maxPrefillBatch` exists: docs/engine.md, "A step").
 * Run: PRESET=smollm2-135m BATCHES=1,2,4,8,32 LENGTH=17 node --import tsx packages/engine/bench/prefill-batch.ts
 */
import * as ort from 'onnxruntime-node';
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { physicalCores } from '../src/physical-cores.js';
import { rewriteDecoderGraph, rewrittenSessionConfig } from '../src/rewrite-decoder-graph.js';
import { decodeFeeds } from './decode-feeds.js';
import { median } from './raw-session.js';

const preset = (process.env.PRESET ?? 'bench') as 'bench';
const model = await loadModelDir(await ensureBuiltinModel(preset));
const rewritten = await rewriteDecoderGraph(model.onnxPath);
if (rewritten === undefined) throw new Error('the graph has no pattern the engine rewrites');
// The engine's thread count (one intra-op thread per physical core), whatever onnxruntime would pick.
const session = await ort.InferenceSession.create(rewritten.bytes, {
  graphOptimizationLevel: 'all',
  logSeverityLevel: 3,
  intraOpNumThreads: physicalCores(),
  extra: { session: rewrittenSessionConfig(rewritten) },
});
const fetches = ['logits', ...rewritten.newKvNames];
const length = Number(process.env.LENGTH ?? 17);
const batches = (process.env.BATCHES ?? '1,2,4,8,32').split(',').map(Number);
const rounds = Number(process.env.ROUNDS ?? 3);
const shapes = batches.map((rows): [rows: number, tokens: number] => [rows, length]);
const longest = Math.max(...batches);
if (longest > 1) shapes.push([1, longest * length]);
const inputs = shapes.map(([rows, tokens]) => decodeFeeds(model.io, { rows, past: 0, tokens }));
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
console.log(`${preset}: prefill calls, medians of ${rounds * 4}`);
for (const [k, [rows, tokens]] of shapes.entries()) {
  const ms = median(times[k]!);
  console.log(`${rows} × ${tokens} tokens: ${ms.toFixed(1)} ms${rows > 1 ? ` (${(ms / rows).toFixed(1)} ms per prompt)` : ''}`);
}
await session.release();
