import { describe, expect, it } from 'vitest';
import { sideOrder, sideOrderRounds } from '../bench/serve/side-order.js';

describe("bench:serve's side order (a Williams design)", () => {
  for (let n = 1; n <= 6; n++) {
    it(`balances positions and predecessors over its rounds for ${n} side(s)`, () => {
      const sides = Array.from({ length: n }, (_, i) => `side ${i}`);
      const rounds = sideOrderRounds(n);
      const rows = Array.from({ length: rounds }, (_, r) => sideOrder(sides, r));
      for (const row of rows) expect([...row].sort()).toEqual(sides);
      // Every side runs in every position equally often.
      for (let position = 0; position < n; position++)
        for (const side of sides) expect(rows.filter((row) => row[position] === side)).toHaveLength(rounds / n);
      // Every side runs right after every other side equally often.
      const follows = new Map<string, number>();
      for (const row of rows)
        for (let i = 1; i < n; i++) follows.set(`${row[i - 1]} → ${row[i]}`, (follows.get(`${row[i - 1]} → ${row[i]}`) ?? 0) + 1);
      if (n > 1) {
        expect(follows.size).toBe(n * (n - 1));
        expect(new Set(follows.values())).toEqual(new Set([(rounds * (n - 1)) / (n * (n - 1))]));
      }
      // The design repeats after its rounds.
      expect(sideOrder(sides, rounds)).toEqual(rows[0]);
    });
  }

  it('keeps two sides as forward, then reversed', () => {
    expect([0, 1, 2, 3].map((r) => sideOrder(['a', 'b'], r).join(''))).toEqual(['ab', 'ba', 'ab', 'ba']);
  });
});
