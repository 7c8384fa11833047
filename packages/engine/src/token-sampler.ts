import type { ResolvedSampling } from './resolve-request.js';
import type { PositionedRandom } from './seeded-random.js';

/** One chosen token, with its logprob under the model's raw distribution when asked for. */
export interface SampledToken {
  tokenId: number;
  logprob?: number;
  topLogprobs?: Array<{ tokenId: number; logprob: number }>;
}

/** Temperatures below this are greedy (vLLM's threshold). */
const GREEDY_TEMPERATURE = 1e-5;

// Sampling runs synchronously, one sequence at a time, so these buffers are shared by all samplers.
let scores = new Float32Array(0);
let weights = new Float64Array(0);
let candidates = new Int32Array(0);
let ordered = new Int32Array(0);

/**
 * Picks the next token of ONE sequence from its logits row. Everything it reads is the sequence's
 * own: its row, its output token counts, its generator; so its choice does not depend on the
 * other sequences of the batch.
 *
 * Order (vLLM's): logit bias, repetition penalty (prompt + output tokens), frequency and presence
 * penalties (output tokens), then greedy argmax, or temperature → min_p → top_k → top_p → draw.
 * Logprobs are those of the raw model distribution (before bias, penalties and temperature), as
 * vLLM reports them by default.
 */
export class TokenSampler {
  readonly #params: ResolvedSampling;
  readonly #promptTokens: ReadonlySet<number>;
  readonly #random: Pick<PositionedRandom, 'next'>;
  readonly #outputCounts = new Map<number, number>();
  /** A bias or a penalty changes the logits: they are copied before sampling. */
  readonly #adjusted: boolean;

  /**
   * @param promptTokens distinct prompt token ids (shared by siblings; only read)
   */
  constructor(params: ResolvedSampling, promptTokens: ReadonlySet<number>, random: Pick<PositionedRandom, 'next'>) {
    this.#params = params;
    this.#promptTokens = promptTokens;
    this.#random = random;
    this.#adjusted =
      params.logitBias.length > 0 || params.repetitionPenalty !== 1 || params.frequencyPenalty !== 0 || params.presencePenalty !== 0;
  }

  /**
   * Counts tokens sampled elsewhere as this sampler's own output (a continuation: the penalties see
   * them as the original run's sampler did).
   */
  prime(tokenIds: readonly number[]): void {
    for (const tokenId of tokenIds) this.#outputCounts.set(tokenId, (this.#outputCounts.get(tokenId) ?? 0) + 1);
  }

  sample(logits: Float32Array, offset: number, vocabSize: number): SampledToken {
    const row = logits.subarray(offset, offset + vocabSize);
    const p = this.#params;
    let source: Float32Array = row;
    if (this.#adjusted) {
      source = this.#adjust(row);
    }
    const tokenId = p.temperature < GREEDY_TEMPERATURE ? argmax(source) : this.#draw(source);
    this.#outputCounts.set(tokenId, (this.#outputCounts.get(tokenId) ?? 0) + 1);

    if (!p.logprobs) return { tokenId };
    const lse = logSumExp(row);
    const sampled: SampledToken = { tokenId, logprob: row[tokenId]! - lse };
    if (p.topLogprobs > 0) {
      sampled.topLogprobs = topIndices(row, p.topLogprobs).map((id) => ({ tokenId: id, logprob: row[id]! - lse }));
    }
    return sampled;
  }

  #adjust(row: Float32Array): Float32Array {
    if (scores.length < row.length) scores = new Float32Array(row.length);
    const out = scores.subarray(0, row.length);
    out.set(row);
    const { logitBias, repetitionPenalty, frequencyPenalty, presencePenalty } = this.#params;
    for (const [id, bias] of logitBias) out[id] = out[id]! + bias;
    if (repetitionPenalty !== 1) {
      const apply = (id: number): void => {
        const value = out[id]!;
        out[id] = value > 0 ? value / repetitionPenalty : value * repetitionPenalty;
      };
      for (const id of this.#promptTokens) apply(id);
      for (const id of this.#outputCounts.keys()) if (!this.#promptTokens.has(id)) apply(id);
    }
    if (frequencyPenalty !== 0 || presencePenalty !== 0) {
      for (const [id, count] of this.#outputCounts) {
        out[id] = out[id]! - frequencyPenalty * count - presencePenalty;
      }
    }
    return out;
  }

  #draw(source: Float32Array): number {
    const { temperature, minP, topK, topP } = this.#params;
    const size = source.length;
    if (weights.length < size) {
      weights = new Float64Array(size);
      candidates = new Int32Array(size);
    }
    let max = -Infinity;
    for (let i = 0; i < size; i++) if (source[i]! > max) max = source[i]!;
    if (max === -Infinity || Number.isNaN(max)) return argmax(source);

    // Unnormalized probabilities: the best token weighs 1, so min_p compares weights directly.
    const invTemperature = 1 / temperature;
    let count = 0;
    let total = 0;
    for (let i = 0; i < size; i++) {
      const w = Math.exp((source[i]! - max) * invTemperature);
      weights[i] = w;
      if (w > 0 && w >= minP) {
        candidates[count++] = i;
        total += w;
      }
    }

    let chosen = candidates.subarray(0, count);
    const limitK = topK > 0 && topK < count;
    if (limitK || topP < 1) {
      if (!limitK) {
        // The nucleus is the shortest most-likely-first prefix reaching top_p × total. Candidates
        // below this floor weigh less than (1 - top_p) × total together, so that prefix lies
        // among the others: dropping them first only shrinks the heap. The target stays top_p ×
        // the full total (not of what is kept here).
        const floor = ((1 - topP) * total) / count;
        let kept = 0;
        for (let j = 0; j < count; j++) {
          const id = candidates[j]!;
          if (weights[id]! >= floor) candidates[kept++] = id;
        }
        count = kept;
      }
      // Take candidates most likely first (lower id first on ties) only as far as needed: O(V) to
      // build the heap, then O(log V) per token taken, instead of sorting the whole vocabulary.
      const heap = new CandidateHeap(candidates, count, weights);
      if (ordered.length < count) ordered = new Int32Array(candidates.length);
      let taken = 0;
      if (limitK) {
        while (taken < topK) ordered[taken++] = heap.pop();
      }
      if (topP < 1) {
        let target = total;
        if (limitK) {
          // top_p applies to the distribution left by top_k, renormalized.
          target = 0;
          for (let j = 0; j < taken; j++) target += weights[ordered[j]!]!;
        }
        target *= topP;
        const available = limitK ? taken : count;
        let cumulative = 0;
        let keep = 0;
        while (keep < available) {
          if (keep === taken) ordered[taken++] = heap.pop();
          cumulative += weights[ordered[keep]!]!;
          keep++;
          if (cumulative >= target) break;
        }
        taken = keep;
      }
      chosen = ordered.subarray(0, taken);
    }

    let sum = 0;
    for (const id of chosen) sum += weights[id]!;
    const u = this.#random.next() * sum;
    let cumulative = 0;
    for (const id of chosen) {
      cumulative += weights[id]!;
      if (cumulative > u) return id;
    }
    return chosen[chosen.length - 1] ?? argmax(source);
  }
}

/**
 * A binary max-heap of token ids, built in place over `ids[0, size)`, ordered by weight, then by
 * lower id: the order in which the sampler walks candidates, so seeded draws depend on it.
 */
class CandidateHeap {
  readonly #ids: Int32Array;
  readonly #weights: Float64Array;
  #size: number;

  constructor(ids: Int32Array, size: number, weights: Float64Array) {
    this.#ids = ids;
    this.#weights = weights;
    this.#size = size;
    for (let i = (size >> 1) - 1; i >= 0; i--) this.#siftDown(i);
  }

  /** Removes and returns the most likely id; the heap must not be empty. */
  pop(): number {
    const ids = this.#ids;
    const top = ids[0]!;
    this.#size--;
    if (this.#size > 0) {
      ids[0] = ids[this.#size]!;
      this.#siftDown(0);
    }
    return top;
  }

  #before(a: number, b: number): boolean {
    const wa = this.#weights[a]!;
    const wb = this.#weights[b]!;
    return wa > wb || (wa === wb && a < b);
  }

  #siftDown(from: number): void {
    const ids = this.#ids;
    const size = this.#size;
    const id = ids[from]!;
    let at = from;
    for (;;) {
      let child = 2 * at + 1;
      if (child >= size) break;
      if (child + 1 < size && this.#before(ids[child + 1]!, ids[child]!)) child++;
      if (!this.#before(ids[child]!, id)) break;
      ids[at] = ids[child]!;
      at = child;
    }
    ids[at] = id;
  }
}

/** Index of the largest value; the lowest index wins ties; NaN never wins. */
export function argmax(values: Float32Array): number {
  let best = 0;
  let bestValue = -Infinity;
  for (let i = 0; i < values.length; i++) {
    const value = values[i]!;
    if (value > bestValue) {
      bestValue = value;
      best = i;
    }
  }
  return best;
}

/** log Σ exp(values), computed in float64. */
export function logSumExp(values: Float32Array): number {
  let max = -Infinity;
  for (let i = 0; i < values.length; i++) if (values[i]! > max) max = values[i]!;
  if (max === -Infinity) return -Infinity;
  let sum = 0;
  for (let i = 0; i < values.length; i++) sum += Math.exp(values[i]! - max);
  return max + Math.log(sum);
}

/** Indices of the k largest values, largest first (lower index first on ties). */
export function topIndices(values: Float32Array, k: number): number[] {
  const ids: number[] = [];
  for (let i = 0; i < values.length; i++) {
    const value = values[i]!;
    if (ids.length === k) {
      if (!(value > values[ids[k - 1]!]!)) continue;
      ids.pop();
    }
    let at = ids.length;
    while (at > 0 && value > values[ids[at - 1]!]!) at--;
    ids.splice(at, 0, i);
  }
  return ids;
}
