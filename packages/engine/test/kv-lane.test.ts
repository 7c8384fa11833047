import { describe, expect, it } from 'vitest';
import { KvBatch, type KvShape } from '../src/kv-batch.js';
import { KV_BLOCK, LaneKv } from '../src/kv-lane.js';
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
    expect(Math.max(...capacities)).toBe(1000);
    expect(rowOf(lane, 0)).toMatchObject({ restZero: true });
    expect(rowOf(lane, 0).slots[1]!.slice(0, 10)).toEqual(expected(1, 10)[1]);
  });

  it('keeps its buffers when a row with a slightly longer reservation joins later, and an emptied lane starts small', () => {
    const lane = new LaneKv(shape, 2);
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

  it('never sizes the capacity past the rows reservation', () => {
    const lane = new LaneKv(shape);
    lane.addRow(prefilled(1, 10).rowSource(0), 20);
    expect(lane.capacity).toBe(20);
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
});
