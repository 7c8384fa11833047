/**
 * `BASELINE_TREE=<checkout> node --import tsx bench/gateway/sse-ab.ts [pairs]`: the SSE write path of
 * this tree's gateway against another checkout's (built, with its own `bench/gateway/sse-throughput.ts`),
 * each beside the minimal `node:http` writer, in rotating order: what a change to the write path
 * gave, side by side in one run. Prints events per server CPU-second per round and the medians.
 * BENCH_STREAMS (1000), BENCH_EVENTS (150), BENCH_WARMUP_EVENTS (150), BENCH_STEP_MS (40) as in
 * `npm run bench:gateway` (a checkout older than the warm-up measures without one).
 */
import { measureRound, type ThroughputRound } from './sse-throughput.js';
import { median, round } from './stats.js';

const tree = process.env.BASELINE_TREE;
if (tree === undefined) throw new Error('BASELINE_TREE: the checkout to compare with');
const other = (await import(`${tree}/bench/gateway/sse-throughput.ts`)) as { measureRound: typeof measureRound };
const pairs = Number(process.argv[2] ?? 8);
const streams = Number(process.env.BENCH_STREAMS ?? 1000);
const events = Number(process.env.BENCH_EVENTS ?? 150);
const stepMs = Number(process.env.BENCH_STEP_MS ?? 40);
const warmup = Number(process.env.BENCH_WARMUP_EVENTS ?? 150);

type Side = 'raw' | 'before' | 'after';
const run: Record<Side, () => Promise<ThroughputRound>> = {
  raw: () => measureRound('baseline', streams, events, stepMs, warmup),
  before: () => other.measureRound('gateway', streams, events, stepMs, warmup),
  after: () => measureRound('gateway', streams, events, stepMs, warmup),
};
const orders: Side[][] = [
  ['raw', 'before', 'after'],
  ['after', 'before', 'raw'],
  ['before', 'after', 'raw'],
  ['raw', 'after', 'before'],
];
const rates: Record<Side, number[]> = { raw: [], before: [], after: [] };
const gain: number[] = [];
for (let i = 0; i < pairs; i++) {
  const round_ = {} as Record<Side, ThroughputRound>;
  for (const side of orders[i % orders.length]!) round_[side] = await run[side]();
  for (const side of ['raw', 'before', 'after'] as const) rates[side].push(round_[side].eventsPerCpuSecond);
  gain.push(round_.after.eventsPerCpuSecond / round_.before.eventsPerCpuSecond);
  const frames = (side: Side) => round(round_[side].dataFrames / streams, 0);
  console.log(
    `round ${i + 1}: events per server CPU-s raw ${Math.round(round_.raw.eventsPerCpuSecond)}, before ${Math.round(round_.before.eventsPerCpuSecond)} ` +
      `(${frames('before')} frames/stream), after ${Math.round(round_.after.eventsPerCpuSecond)} (${frames('after')}); after ÷ before ${round(gain.at(-1)!)}`,
  );
}
const m = (side: Side) => Math.round(median(rates[side]));
console.log(
  `medians: raw ${m('raw')}, before ${m('before')} (${round(m('before') / m('raw'))}× raw), after ${m('after')} (${round(m('after') / m('raw'))}× raw); ` +
    `after ÷ before per round, median ${round(median(gain))}`,
);
