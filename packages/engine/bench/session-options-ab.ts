/**
 * onnxruntime session options side by side on one decode call shape: each config's session runs the
 * same call (ROWS rows at past PAST, the graph rewritten as the engine loads it), 100 calls per round,
 * configs in turn, ROUNDS rounds; prints each round's median call time and the process CPU per call.
 * CPU per call ≈ wall time says a config ran on one core.
 * Run: CONFIGS='[["default",{}],["two threads",{"intraOpNumThreads":2}]]' ROWS=1 PAST=64 ROUNDS=6 \
 *      node --import tsx packages/engine/bench/session-options-ab.ts   (PRESET=smollm2-135m for that model)
 */
import * as ort from 'onnxruntime-node';
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { rewriteDecoderGraph, rewrittenSessionConfig } from '../src/rewrite-decoder-graph.js';
import { decodeFeeds } from './decode-feeds.js';
import { median } from './raw-session.js';
const model = await loadModelDir(await ensureBuiltinModel((process.env.PRESET ?? 'bench') as 'bench'));
const rows = Number(process.env.ROWS ?? 1);
const past = Number(process.env.PAST ?? 64);
const rewritten = await rewriteDecoderGraph(model.onnxPath);
const configs = JSON.parse(process.env.CONFIGS ?? '[["default",{}]]') as Array<[string, ort.InferenceSession.SessionOptions]>;
const sessions = await Promise.all(
  configs.map(([, extra]) =>
    ort.InferenceSession.create(rewritten!.bytes, {
      graphOptimizationLevel: 'all',
      logSeverityLevel: 3,
      ...extra,
      extra: { session: { ...rewrittenSessionConfig(rewritten!), ...(extra.extra as { session?: object } | undefined)?.session } },
    }),
  ),
);
const feeds = decodeFeeds(model.io, { rows, past });
const fetches = ['logits', ...rewritten!.newKvNames];
const results = configs.map(() => ({ wall: [] as number[], cpu: [] as number[] }));
for (const s of sessions) for (let i = 0; i < 20; i++) await s.run(feeds, fetches);
for (let round = 0; round < Number(process.env.ROUNDS ?? 6); round++) {
  for (const [k, s] of sessions.entries()) {
    const c0 = process.cpuUsage();
    const times: number[] = [];
    for (let i = 0; i < 100; i++) {
      const t = performance.now();
      await s.run(feeds, fetches);
      times.push(performance.now() - t);
    }
    const c = process.cpuUsage(c0);
    results[k]!.wall.push(median(times));
    results[k]!.cpu.push((c.user + c.system) / 1000 / 100);
  }
}
for (const [k, [name]] of configs.entries())
  console.log(
    `${name.padEnd(24)} run p50 by round ${results[k]!.wall.map((x) => x.toFixed(2)).join(' ')} | median ${median(results[k]!.wall).toFixed(2)} ms, cpu/run ${median(results[k]!.cpu).toFixed(2)} ms`,
  );
