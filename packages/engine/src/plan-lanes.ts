/**
 * Splits the decode rows into lanes: batches run as separate model calls in the same step.
 *
 * A batch is left-padded to its longest row, and on CPU a decode call's cost grows with
 * rows × padded length (the graph concatenates, transposes and returns the whole KV cache every
 * step) on top of a fixed cost per call (reading every weight once). Rows of very different
 * lengths therefore cost less in two calls than padded into one. With rows sorted by length the
 * best split is contiguous, so a small dynamic program finds it.
 *
 * @param lengths cached lengths of the rows, ascending
 * @param laneCost the fixed cost of one call, in padded KV slots
 * @returns the sizes of consecutive lanes over `lengths`
 */
export function planLanes(lengths: readonly number[], laneCost: number, maxLanes = 8): number[] {
  const n = lengths.length;
  if (n === 0) return [];
  // best[k][j]: least cost of the first j rows in k lanes.
  let best = new Float64Array(n + 1).fill(Infinity);
  best[0] = 0;
  const splits: Int32Array[] = [];
  let bestLanes = 0;
  let bestCost = Infinity;
  for (let k = 1; k <= Math.min(maxLanes, n); k++) {
    const next = new Float64Array(n + 1).fill(Infinity);
    const from = new Int32Array(n + 1);
    for (let j = 1; j <= n; j++) {
      for (let i = k - 1; i < j; i++) {
        const cost = best[i]! + laneCost + (j - i) * lengths[j - 1]!;
        if (cost < next[j]!) {
          next[j] = cost;
          from[j] = i;
        }
      }
    }
    splits.push(from);
    best = next;
    if (best[n]! < bestCost) {
      bestCost = best[n]!;
      bestLanes = k;
    }
  }
  const sizes: number[] = [];
  for (let k = bestLanes, j = n; k >= 1; k--) {
    const i = splits[k - 1]![j]!;
    sizes.unshift(j - i);
    j = i;
  }
  return sizes;
}

/** Lanes of rows of one length each: for graphs that cannot express padding (GroupQueryAttention). */
export function exactLengthLanes(lengths: readonly number[]): number[] {
  const sizes: number[] = [];
  lengths.forEach((length, i) => {
    if (i > 0 && length === lengths[i - 1]) sizes[sizes.length - 1]! += 1;
    else sizes.push(1);
  });
  return sizes;
}
