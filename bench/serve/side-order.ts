/**
 * The order in which a round runs its sides: a Williams design, so that over its rounds every side
 * runs in every position equally often and right after every other side equally often.
 *
 * With only forward and reversed orders (what bench:serve did until stop 46), a side in the middle of
 * three stayed in the middle in every round and ran right after the same side every other round: an
 * A/A run of two identical Sluice stacks put the middle one 26 ms later at its second token's p50.
 *
 * Rows for n sides: the first is 0, 1, n−1, 2, n−2, …; row r adds r to each (mod n). For even n these
 * n rows balance positions and immediate predecessors; for odd n the same n rows reversed follow them
 * (2n rows in all). Two sides: forward, reversed — as before.
 */
export function sideOrder<T>(sides: readonly T[], round: number): T[] {
  const n = sides.length;
  if (n === 0) return [];
  const first = [0];
  for (let i = 1; i < n; i++) first.push(i % 2 === 1 ? (i + 1) / 2 : n - i / 2);
  const cycle = sideOrderRounds(n);
  const r = ((round % cycle) + cycle) % cycle;
  const row = first.map((index) => sides[(index + r) % n]!);
  return r >= n ? row.reverse() : row;
}

/** Rounds after which `sideOrder` has balanced positions and predecessors: n for even n, 2n for odd n (1 for one side). */
export function sideOrderRounds(n: number): number {
  if (n <= 1) return 1;
  return n % 2 === 0 ? n : 2 * n;
}
