import { describe, expect, it } from 'vitest';
import { KvBatch, type KvShape } from '../src/kv-batch.js';
import { packInputs } from '../src/pack-inputs.js';

const shape: KvShape = { numLayers: 1, numKvHeads: 2, headDim: 2, dtype: 'float32' };

/** A row's tensor: every element encodes (row tag, head, slot, dim) so copies can be traced. */
function batchOf(rows: Array<{ tag: number; length: number }>, pastLength: number): KvBatch {
  const data = [0, 1].map((kind) => {
    const out = new Float32Array(rows.length * 2 * pastLength * 2);
    rows.forEach(({ tag, length }, r) => {
      for (let h = 0; h < 2; h++) {
        for (let s = pastLength - length; s < pastLength; s++) {
          const position = s - (pastLength - length);
          for (let d = 0; d < 2; d++) out[((r * 2 + h) * pastLength + s) * 2 + d] = kind * 1000 + tag * 100 + h * 10 + position + d / 10;
        }
      }
    });
    return out;
  });
  return new KvBatch(
    shape,
    data,
    rows.map((row) => row.length),
    pastLength,
  );
}

/** The real slots of one row/head as values, padding excluded. */
function realSlots(batch: KvBatch, row: number, head: number, k = 0): number[] {
  const out: number[] = [];
  const p = batch.pastLength;
  for (let s = p - batch.lengths[row]!; s < p; s++) out.push(batch.data[k]![((row * 2 + head) * p + s) * 2]!);
  return out;
}

describe('KvBatch', () => {
  it('repacks kept and joining rows, left-padded to the longest, padding zero', () => {
    const running = batchOf(
      [
        { tag: 1, length: 3 },
        { tag: 2, length: 5 },
        { tag: 3, length: 2 },
      ],
      5,
    );
    const newcomer = batchOf([{ tag: 4, length: 4 }], 4);
    // row 1 (the longest) leaves: the batch shrinks to 4 slots
    const next = KvBatch.gather(shape, [running.rowSource(0), running.rowSource(2), newcomer.rowSource(0), newcomer.rowSource(0)]);
    expect(next.pastLength).toBe(4);
    expect(next.lengths).toEqual([3, 2, 4, 4]);
    expect(realSlots(next, 0, 1)).toEqual([110, 111, 112]);
    expect(realSlots(next, 1, 0)).toEqual([300, 301]);
    expect(realSlots(next, 3, 1, 1)).toEqual([1410, 1411, 1412, 1413]);
    // padding of row 1 (two slots, both heads, both dims) is zero
    expect(Array.from(next.data[0]!.subarray((1 * 2 + 0) * 4 * 2, ((1 * 2 + 0) * 4 + 2) * 2))).toEqual([0, 0, 0, 0]);
    expect(next.slotCount).toBe(16);
  });

  it("takes a call's present tensors as they are when every row filled the new slots", () => {
    const batch = batchOf(
      [
        { tag: 1, length: 2 },
        { tag: 2, length: 3 },
      ],
      3,
    );
    const present = [new Float32Array(2 * 2 * 4 * 2), new Float32Array(2 * 2 * 4 * 2)];
    const next = batch.appended(present, 1, [1, 1]);
    expect(next.data[0]).toBe(present[0]);
    expect(next.lengths).toEqual([3, 4]);
    expect(next.pastLength).toBe(4);
  });

  it('squeezes out the gap a shorter row leaves in a ragged call', () => {
    // past: row 0 has 1 real slot of 2, row 1 has 2; new: row 0 feeds 1 token, row 1 feeds 2
    const batch = batchOf(
      [
        { tag: 1, length: 1 },
        { tag: 2, length: 2 },
      ],
      2,
    );
    const present = batchOf(
      [
        { tag: 1, length: 4 },
        { tag: 2, length: 4 },
      ],
      4,
    ).data;
    const next = batch.appended(present, 2, [1, 2]);
    expect(next.lengths).toEqual([2, 4]);
    // row 0 kept its past slot (position 1 of the 4-slot tensor) and its new slot (position 3)
    expect(realSlots(next, 0, 0)).toEqual([101, 103]);
    expect(realSlots(next, 1, 0)).toEqual([200, 201, 202, 203]);
  });

  it('holds nothing once every row is gone', () => {
    const batch = batchOf([{ tag: 1, length: 3 }], 3);
    const empty = KvBatch.gather(shape, []);
    expect(empty.slotCount).toBe(0);
    expect(batch.slotCount).toBe(3);
  });
});

describe('packInputs', () => {
  it('left-pads new tokens, masks padding and gives each row its true positions', () => {
    const inputs = packInputs(
      3,
      [
        { cachedLength: 1, tokens: [7, 8] },
        { cachedLength: 3, tokens: [9] },
      ],
      0,
    );
    expect(inputs.newTokens).toBe(2);
    expect(Array.from(inputs.inputIds, Number)).toEqual([7, 8, 0, 9]);
    expect(Array.from(inputs.attentionMask, Number)).toEqual([0, 0, 1, 1, 1, 1, 1, 1, 0, 1]);
    expect(Array.from(inputs.positionIds, Number)).toEqual([1, 2, 0, 3]);
  });
});
