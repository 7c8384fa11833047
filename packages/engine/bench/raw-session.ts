/**
 * Model-only measurements with the engine's own session wrapper on the host thread: what one
 * session.run costs for a given batch, with no scheduling, sampling or detokenizing around it.
 */
import { KvBatch, type KvShape } from '../src/kv-batch.js';
import type { OnnxSession } from '../src/onnx-session.js';
import { LaneKv } from '../src/kv-lane.js';
import { packInputs, packLaneInputs, type RowInput } from '../src/pack-inputs.js';

export function filledBatch(shape: KvShape, lengths: readonly number[]): KvBatch {
  const pastLength = Math.max(0, ...lengths);
  const size = lengths.length * shape.numKvHeads * pastLength * shape.headDim;
  // Random values, tiled: filling hundreds of MB one Math.random() at a time would dominate the bench.
  const tile = Float32Array.from({ length: 65_536 }, () => Math.random() - 0.5);
  const data = Array.from({ length: shape.numLayers * 2 }, () => {
    const out = new Float32Array(size);
    for (let at = 0; at < size; at += tile.length) out.set(tile.subarray(0, Math.min(tile.length, size - at)), at);
    return out;
  });
  return new KvBatch(shape, data, lengths, pastLength);
}

export async function timedRun(session: OnnxSession, past: KvBatch, rows: readonly RowInput[]) {
  const inputs = packInputs(past.pastLength, rows, 0);
  const start = performance.now();
  const output = await session.run(inputs, past);
  return { ms: performance.now() - start, output, inputs };
}

/**
 * Decode steps of one fixed batch, the way the engine runs them (present → next past), timing
 * only session.run.
 */
export async function rawDecodeSteps(session: OnnxSession, start: KvBatch, steps: number): Promise<number[]> {
  if (session.outputsNewKv) return rawLaneSteps(session, start, steps);
  return rawPresentSteps(session, start, steps);
}

/** {@link rawDecodeSteps} the old way: fetch every present.* and use it as the next past. */
export async function rawPresentSteps(session: OnnxSession, start: KvBatch, steps: number): Promise<number[]> {
  let batch = start;
  const times: number[] = [];
  for (let step = 0; step < steps; step++) {
    const rows = batch.lengths.map((cachedLength) => ({ cachedLength, tokens: [5 + (step % 100)] }));
    const { ms, output } = await timedRun(session, batch, rows);
    times.push(ms);
    batch = batch.appended(
      output.present,
      1,
      rows.map(() => 1),
    );
  }
  return times;
}

/**
 * {@link rawDecodeSteps} with an engine-owned cache (as the engine runs when the session outputs
 * new key/value slices): fetch logits + new slices, write them in place; timing session.run only.
 */
export async function rawLaneSteps(session: OnnxSession, start: KvBatch, steps: number): Promise<number[]> {
  const lane = new LaneKv(start.shape);
  start.lengths.forEach((_, row) => lane.addRow(start.rowSource(row), Infinity));
  const times: number[] = [];
  for (let step = 0; step < steps; step++) {
    lane.reserveNext(Infinity);
    const inputs = packLaneInputs(
      lane.capacity,
      lane.lengths.map((cachedLength) => ({ cachedLength, token: 5 + (step % 100) })),
    );
    const begin = performance.now();
    const output = await session.runNewKv(inputs, lane);
    times.push(performance.now() - begin);
    lane.append(output.newKv);
  }
  return times;
}

export interface MixedVsSeparate {
  decodeRows: number;
  pastLength: number;
  newcomerTokens: number;
  /** One decode call for the running rows + one prefill call for the newcomer. */
  separateMs: number;
  /** One ragged call (running rows left-padded to the newcomer's length) + squeezing out the gaps. */
  mixedMs: number;
}

export async function mixedVsSeparate(
  session: OnnxSession,
  decodeRows: number,
  pastLength: number,
  newcomerTokens: number,
  repeats: number,
): Promise<MixedVsSeparate> {
  const shape = session.io.kv;
  const running = filledBatch(shape, new Array<number>(decodeRows).fill(pastLength));
  const decode = running.lengths.map((cachedLength) => ({ cachedLength, tokens: [7] }));
  const prompt = { cachedLength: 0, tokens: Array.from({ length: newcomerTokens }, (_, i) => 3 + i) };
  const mixedPast = KvBatch.gather(shape, [
    ...running.lengths.map((_, row) => running.rowSource(row)),
    { data: running.data, slots: pastLength, row: 0, segments: [] },
  ]);
  const separate: number[] = [];
  const mixed: number[] = [];
  // The session is warm (earlier sections ran it); the ragged call is slow enough not to repeat much.
  for (let repeat = 1; repeat <= repeats; repeat++) {
    const a = await timedRun(session, running, decode);
    const b = await timedRun(session, KvBatch.empty(shape, 1), [prompt]);
    const start = performance.now();
    const { output } = await timedRun(session, mixedPast, [...decode, prompt]);
    mixedPast.appended(output.present, newcomerTokens, [...decode.map(() => 1), newcomerTokens]);
    const mixedMs = performance.now() - start;
    separate.push(a.ms + b.ms);
    mixed.push(mixedMs);
  }
  return { decodeRows, pastLength, newcomerTokens, separateMs: median(separate), mixedMs: median(mixed) };
}

export function median(values: readonly number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  if (sorted.length === 0) return Number.NaN;
  const mid = Math.floor(sorted.length / 2);
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
}

export function percentile(values: readonly number[], p: number): number {
  const sorted = [...values].sort((a, b) => a - b);
  if (sorted.length === 0) return Number.NaN;
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))]!;
}
