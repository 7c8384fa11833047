import type { Histogram } from 'prom-client';

/** The layout prom-client 15 keeps for each label set of a histogram (`histogram.hashMap`). */
interface HistogramEntry {
  bucketValues: Record<number, number>;
  sum: number;
  count: number;
}

/**
 * Observations of an unlabelled prom-client histogram, kept as plain bucket counts on the hot path
 * and folded into the histogram when it is read (its `collect()` callback calls {@link fold}).
 *
 * Why: prom-client's `observe` validates and hashes the labels and allocates a closure on every call;
 * the gateway observes inter-token latency once per step per stream. Here an observation is a bucket
 * search over a dozen bounds and three additions, and a scrape folds a whole interval in O(buckets),
 * however many observations it holds (replaying them through `observe` would stall the event loop at
 * every scrape instead).
 */
export class PendingHistogram {
  readonly #bounds: readonly number[];
  /** Observations per bucket (not cumulative); the last slot is `+Inf`. */
  readonly #counts: Float64Array;
  #sum = 0;
  #count = 0;

  /** @param bounds the histogram's upper bounds, ascending (the `buckets` it was made with) */
  constructor(bounds: readonly number[]) {
    this.#bounds = bounds;
    this.#counts = new Float64Array(bounds.length + 1);
  }

  /** Observations not yet folded in. */
  get pending(): number {
    return this.#count;
  }

  observe(value: number): void {
    const bounds = this.#bounds;
    let i = 0;
    while (i < bounds.length && value > bounds[i]!) i++;
    this.#counts[i]!++;
    this.#sum += value;
    this.#count++;
  }

  /** Adds the pending observations to `histogram` (made with the same buckets, no labels) and clears them. */
  fold(histogram: Histogram): void {
    if (this.#count === 0) return;
    const entry = entryOf(histogram);
    const bounds = this.#bounds;
    for (let i = 0; i < bounds.length; i++) {
      const n = this.#counts[i]!;
      if (n !== 0) entry.bucketValues[bounds[i]!] = (entry.bucketValues[bounds[i]!] ?? 0) + n;
    }
    entry.sum += this.#sum;
    entry.count += this.#count;
    this.#counts.fill(0);
    this.#sum = 0;
    this.#count = 0;
  }
}

/**
 * The histogram's unlabelled series. prom-client has no public way to add bucket counts, so this
 * reaches into its value map (tested against the scrape output in `gateway-metrics.test.ts`, which
 * fails loudly if a prom-client upgrade moves it). `zero({})` creates the series when a reset removed it.
 */
function entryOf(histogram: Histogram): HistogramEntry {
  const series = () => (histogram as unknown as { hashMap: Record<string, HistogramEntry | undefined> }).hashMap[''];
  if (series() === undefined) histogram.zero({});
  const entry = series();
  if (entry === undefined || typeof entry.sum !== 'number' || typeof entry.bucketValues !== 'object') {
    throw new Error('prom-client histogram: unexpected internal layout');
  }
  return entry;
}
