import { describe, expect, it } from 'vitest';
import { KvBatch, type KvShape } from '../src/kv-batch.js';
import { KV_ALIGN, KV_BLOCK, LaneKv } from '../src/kv-lane.js';
import { packLaneInputs } from '../src/pack-inputs.js';

const shape: KvShape = { numLayers: 1, numKvHeads: 2, headDim: 2, dtype: 'float32' };

/** A one-row prefill cache whose slot s of head h holds tag + s + h / 10 (key) and its negation (value). */
function prefilled(tag: number, length: number): KvBatch {
  const key = new Float32Array(2 * length * 2);
  for (let h = 0; h < 2; h++) for (let s = 0; s < length; s++) key.fill(tag + s + h / 10, (h * length + s) * 2, (h * length + s + 1) * 2);
  return new KvBatch(shape, [key, key.map((x) => -x)], [length], length);
}

/** What a row of the lane holds, per head: its real slots' first element, then whether the rest is zero. */
function rowOf(lane: LaneKv, row: number): { slots: number[][]; restZero: boolean } {
  const [key] = lane.data;
  const slots: number[][] = [];
  let restZero = true;
  for (let h = 0; h < 2; h++) {
    const base = (row * 2 + h) * lane.capacity * 2;
    slots.push(Array.from({ length: lane.lengths[row]! }, (_, s) => key![base + s * 2]!));
    for (let at = base + lane.lengths[row]! * 2; at < base + lane.capacity * 2; at++) if (key![at] !== 0) restZero = false;
  }
  return { slots, restZero };
}

const expected = (tag: number, length: number): number[][] =>
  [0, 1].map((h) => Array.from({ length }, (_, s) => Math.fround(tag + s + h / 10)));

describe('LaneKv', () => {
  it('adds rows left-aligned, removes by moving the last row in, appends new slices and regrows in place', () => {
    const lane = new LaneKv(shape);
    lane.addRow(prefilled(100, 3).rowSource(0), 1000);
    lane.addRow(prefilled(200, 200).rowSource(0), 1000);
    lane.addRow(prefilled(300, 5).rowSource(0), 1000);
    expect(lane.capacity).toBe(4 * KV_BLOCK);
    expect(lane.slotCount).toBe(3 * 4 * KV_BLOCK);
    lane.removeRow(1); // row 2 moves to 1
    expect(lane.lengths).toEqual([3, 5]);
    expect(rowOf(lane, 0)).toEqual({ slots: expected(100, 3), restZero: true });
    expect(rowOf(lane, 1)).toEqual({ slots: expected(300, 5), restZero: true });
    lane.reserveNext(1000); // the long row left: shrinks to one block (it wasted more than two)
    expect(lane.capacity).toBe(KV_BLOCK);
    expect(rowOf(lane, 1)).toEqual({ slots: expected(300, 5), restZero: true });
    for (let step = 0; step < KV_BLOCK; step++) {
      lane.reserveNext(1000);
      // New slices: row r, head h gets tag + length + h / 10 (continuing its sequence).
      const slice = new Float32Array(2 * 2 * 2);
      const tags = [100, 300];
      for (let r = 0; r < 2; r++)
        for (let h = 0; h < 2; h++) slice.fill(tags[r]! + lane.lengths[r]! + h / 10, (r * 2 + h) * 2, (r * 2 + h + 1) * 2);
      lane.append([slice, slice.map((x) => -x)]);
    }
    expect(lane.lengths).toEqual([3 + KV_BLOCK, 5 + KV_BLOCK]);
    expect(lane.capacity).toBe(2 * KV_BLOCK);
    expect(rowOf(lane, 0)).toEqual({ slots: expected(100, 3 + KV_BLOCK), restZero: true });
    expect(rowOf(lane, 1)).toEqual({ slots: expected(300, 5 + KV_BLOCK), restZero: true });
    expect(lane.data[1]![0]).toBe(-100);
  });

  it('grows by at least a quarter, so a lane growing a slot per step re-lays out O(log length) times, never past the reservation', () => {
    const lane = new LaneKv(shape, 4);
    lane.addRow(prefilled(1, 10).rowSource(0), 1000);
    lane.addRow(prefilled(2, 30).rowSource(0), 1000);
    const capacities = new Set<number>([lane.capacity]);
    while (lane.lengths[1]! < 999) {
      lane.reserveNext(1000);
      capacities.add(lane.capacity);
      lane.append([new Float32Array(2 * 2 * 2), new Float32Array(2 * 2 * 2)]);
    }
    expect(capacities.size).toBeLessThanOrEqual(12);
    // 768 × 1.25 = 960 would leave one short growth to the reservation (960 → 1000): 768 goes to
    // 1000 rounded up to a multiple of KV_ALIGN, 1008.
    expect([...capacities]).toEqual([64, 128, 192, 256, 320, 448, 576, 768, 1008]);
    expect(rowOf(lane, 0)).toMatchObject({ restZero: true });
    expect(rowOf(lane, 0).slots[1]!.slice(0, 10)).toEqual(expected(1, 10)[1]);
  });

  it('keeps its buffers when a row with a slightly longer reservation joins later, and an emptied lane starts small', () => {
    const lane = new LaneKv(shape, 2, 'in-place');
    lane.addRow(prefilled(100, 10).rowSource(0), 150);
    const buffer = lane.data[0]!.buffer;
    lane.addRow(prefilled(200, 10).rowSource(0), 160);
    // Both rows grow a slot per step up to the longer reservation: re-laid out in place, never reallocated.
    for (let step = 10; step < 159; step++) {
      lane.reserveNext(160);
      lane.append(lane.data.map(() => new Float32Array(2 * 2 * 2)));
    }
    expect(lane.capacity).toBe(160);
    expect(lane.data[0]!.buffer).toBe(buffer);
    // The rows leave; the lane (kept for reuse) sizes itself for its next row, not its last capacity.
    lane.removeRow(1);
    lane.removeRow(0);
    lane.addRow(prefilled(300, 5).rowSource(0), 150);
    expect(lane.capacity).toBe(KV_BLOCK);
    expect(lane.data[0]!.buffer).toBe(buffer);
    expect(rowOf(lane, 0)).toEqual({ slots: expected(300, 5), restZero: true });
  });

  it('preallocated: rows join and grow to their reservation without a reallocation, on pages already faulted in', () => {
    const big: KvShape = { numLayers: 2, numKvHeads: 2, headDim: 64, dtype: 'float32' };
    const rows = 16;
    const limit = 600;
    const source = (length: number) =>
      new KvBatch(
        big,
        Array.from({ length: 4 }, () => new Float32Array(2 * length * 64).fill(1)),
        [length],
        length,
      ).rowSource(0);
    const slices = Array.from({ length: 4 }, () => new Float32Array(rows * 2 * 64).fill(2));
    // Page faults while 16 rows join and grow a slot per step from 20 to 600 slots (~20 MB of cache).
    const faultsWhileServing = (lane: LaneKv): number => {
      const before = process.resourceUsage().minorPageFault;
      for (let row = 0; row < rows; row++) lane.addRow(source(20), limit);
      const buffer = lane.data[0]!.buffer;
      for (let length = 20; length < limit; length++) {
        lane.reserveNext(limit);
        lane.append(slices);
      }
      expect(lane.data[0]!.buffer).toBe(buffer); // never reallocated
      expect(lane.lengths).toEqual(Array.from({ length: rows }, () => limit));
      expect(lane.data[3]![(limit - 1) * 64]).toBe(2); // row 0's last slot
      expect(lane.capacity % KV_ALIGN).toBe(0);
      return process.resourceUsage().minorPageFault - before;
    };
    const cold = faultsWhileServing(new LaneKv(big, rows, 'in-place'));
    const warm = new LaneKv(big, rows, 'in-place');
    // The context allows 2048 slots a row; the KV cap, rows × limit slots, is what gets written.
    warm.preallocate(2048, rows * limit);
    expect(warm.capacity).toBe(0);
    const preallocated = faultsWhileServing(warm);
    console.log(`minor page faults serving 16 rows: ${cold} on a fresh lane, ${preallocated} preallocated`);
    expect(cold).toBeGreaterThan(2000);
    expect(preallocated).toBeLessThan(cold / 10);
  });

  it('keeps the capacity a multiple of KV_ALIGN, never past the rows reservation rounded up to one', () => {
    const lane = new LaneKv(shape);
    lane.addRow(prefilled(1, 10).rowSource(0), 20);
    expect(lane.capacity).toBe(32);
    lane.addRow(prefilled(2, 70).rowSource(0), 130);
    expect(lane.capacity).toBe(144);
    while (lane.lengths[1]! < 129) {
      lane.reserveNext(130);
      expect(lane.capacity % KV_ALIGN).toBe(0);
      lane.append([new Float32Array(2 * 2 * 2 * 2), new Float32Array(2 * 2 * 2 * 2)]);
    }
    expect(lane.capacity).toBe(144);
  });

  it('masks the unused slots and puts the new token at its true position', () => {
    const inputs = packLaneInputs(4, [
      { cachedLength: 2, token: 9 },
      { cachedLength: 4, token: 8 },
    ]);
    expect(Array.from(inputs.attentionMask, Number)).toEqual([1, 1, 0, 0, 1, 1, 1, 1, 1, 1]);
    expect(Array.from(inputs.positionIds, Number)).toEqual([2, 4]);
    expect(Array.from(inputs.inputIds, Number)).toEqual([9, 8]);
  });

  it('spread growth: the same contents as growing in place through random joins, leaves and steps, with fewer whole-lane re-layouts', () => {
    const big: KvShape = { numLayers: 2, numKvHeads: 4, headDim: 64, dtype: 'float32' };
    const slot = big.numKvHeads * big.headDim;
    const lanes = [new LaneKv(big, 24, 'spread'), new LaneKv(big, 24, 'in-place')];
    let seed = 7;
    const random = (): number => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
    const source = (length: number, tag: number): KvBatch => {
      const data = Array.from({ length: 4 }, (_, k) => Float32Array.from({ length: length * slot }, (_, i) => tag + k + i / 1e4));
      return new KvBatch(big, data, [length], length);
    };
    for (let step = 0; step < 900; step++) {
      const rows = lanes[0]!.rows;
      if (rows < 24 && (rows < 4 || random() < 0.04)) {
        const joiner = source(1 + Math.floor(random() * 300), step * 10);
        for (const lane of lanes) lane.addRow(joiner.rowSource(0), 1200);
      }
      if (rows > 4 && random() < 0.03) {
        const row = Math.floor(random() * rows);
        for (const lane of lanes) lane.removeRow(row);
      }
      if (Math.max(...lanes[0]!.lengths) >= 1199) break;
      for (const lane of lanes) lane.reserveNext(1200);
      const slices = Array.from({ length: 4 }, (_, k) =>
        Float32Array.from({ length: lanes[0]!.rows * slot }, (_, i) => -(step + k + i / 1e4)),
      );
      for (const lane of lanes) lane.append(slices);
      const [spread, inPlace] = lanes as [LaneKv, LaneKv];
      expect(spread.lengths).toEqual(inPlace.lengths);
      if (step % 10 === 0) expect(mismatches(spread, inPlace)).toEqual([]);
    }
    expect(mismatches(lanes[0]!, lanes[1]!)).toEqual([]);
    // Both lanes re-lay out in one step to shrink or for a joiner longer than the capacity; only the
    // in-place lane does it to grow.
    expect(lanes[0]!.relayouts).toBeLessThan(lanes[1]!.relayouts - 3);
  });

  it('spread growth: rows growing a slot per step never wait for a whole-lane re-layout', () => {
    const big: KvShape = { numLayers: 2, numKvHeads: 4, headDim: 64, dtype: 'float32' };
    const slot = big.numKvHeads * big.headDim;
    const lanes = [new LaneKv(big, 24, 'spread'), new LaneKv(big, 24, 'in-place')];
    for (let row = 0; row < 24; row++) {
      const length = 8 + row;
      const data = Array.from({ length: 4 }, () => new Float32Array(length * slot).fill(row + 1));
      for (const lane of lanes) lane.addRow(new KvBatch(big, data, [length], length).rowSource(0), 1000);
    }
    const slices = Array.from({ length: 4 }, () => new Float32Array(24 * slot).fill(-1));
    const capacities = new Set<number>();
    while (lanes[0]!.lengths[23]! < 999) {
      for (const lane of lanes) {
        lane.reserveNext(1000);
        lane.append(slices);
      }
      capacities.add(lanes[0]!.capacity);
    }
    expect(capacities.size).toBeGreaterThan(4);
    expect(lanes[1]!.relayouts).toBe(capacities.size - 1);
    expect(lanes[0]!.relayouts).toBe(0);
    expect(mismatches(lanes[0]!, lanes[1]!)).toEqual([]);
  });
});

/** Where two lanes' rows differ in their real slots, or `a` holds a non-zero slot past a row's length. */
function mismatches(a: LaneKv, b: LaneKv): string[] {
  const { numKvHeads: heads, headDim } = a.shape;
  const found: string[] = [];
  a.lengths.forEach((length, row) => {
    a.data.forEach((tensor, k) => {
      const other = b.data[k]!;
      for (let h = 0; h < heads; h++) {
        const at = (row * heads + h) * a.capacity * headDim;
        const bt = (row * heads + h) * b.capacity * headDim;
        for (let i = 0; i < length * headDim; i++)
          if (tensor[at + i] !== other[bt + i]) return void found.push(`row ${row} tensor ${k} head ${h} element ${i}`);
        for (let i = length * headDim; i < a.capacity * headDim; i++)
          if (tensor[at + i] !== 0) return void found.push(`row ${row} tensor ${k} head ${h}: slot ${Math.floor(i / headDim)} not zero`);
      }
    });
  });
  return found;
}
