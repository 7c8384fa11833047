import { describe, expect, it } from 'vitest';
import { exactLengthLanes, planLanes } from '../src/plan-lanes.js';

describe('planLanes', () => {
  it('keeps rows of similar length in one lane', () => {
    expect(planLanes([100, 102, 105, 110], 50)).toEqual([4]);
  });

  it('splits rows of very different lengths when the padding costs more than another call', () => {
    // one lane: 50 + 6 × 400 = 2450; two lanes: 50 + 3 × 12 + 50 + 3 × 400 = 1336
    expect(planLanes([10, 11, 12, 390, 395, 400], 50)).toEqual([3, 3]);
  });

  it('never uses more lanes than allowed, nor splits when a call costs more than the padding saves', () => {
    expect(planLanes([1, 100, 200, 300, 400], 1, 2)).toHaveLength(2);
    expect(planLanes([10, 400], 1000)).toEqual([1 + 1]);
  });

  it('finds the cheapest split', () => {
    const lengths = [3, 5, 40, 41, 44, 90, 200, 210];
    const cost = (sizes: number[]) => {
      let at = 0;
      return sizes.reduce((sum, size) => {
        at += size;
        return sum + 30 + size * lengths[at - 1]!;
      }, 0);
    };
    const best = cost(planLanes(lengths, 30));
    // every split into contiguous lanes costs at least as much
    for (let mask = 0; mask < 1 << (lengths.length - 1); mask++) {
      const sizes: number[] = [1];
      for (let i = 1; i < lengths.length; i++) {
        if (mask & (1 << (i - 1))) sizes.push(1);
        else sizes[sizes.length - 1]! += 1;
      }
      if (sizes.length <= 8) expect(cost(sizes)).toBeGreaterThanOrEqual(best);
    }
  });

  it('groups equal lengths only, for graphs that cannot express padding', () => {
    expect(exactLengthLanes([4, 4, 7, 9, 9, 9])).toEqual([2, 1, 3]);
  });
});
