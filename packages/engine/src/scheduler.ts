/** What the scheduler needs to know about a request (a group of n sibling sequences). */
export interface SchedulableGroup {
  readonly promptLength: number;
  /** Prompt tokens already in the KV cache. */
  readonly prefilled: number;
  /** Batch rows the group holds: n until its prompt is prefilled, then its live siblings. */
  readonly rows: number;
  /** The most KV slots one of its rows can reach: prompt + max_tokens. */
  readonly reservedLength: number;
}

export interface SchedulerLimits {
  maxBatchSize: number;
  maxStepTokens: number;
  maxCachedTokens: number;
}

/** One prompt chunk to prefill this step: tokens [start, start + length) of the group's prompt. */
export interface PrefillChunk<G> {
  group: G;
  start: number;
  length: number;
}

export interface StepPlan<G> {
  /** Groups admitted from the waiting queue this step (they also appear in `prefill`). */
  admitted: G[];
  prefill: Array<PrefillChunk<G>>;
  /** Rows that decode one token this step. */
  decodeRows: number;
}

/**
 * Iteration-level scheduling: which requests run this step, and how many prompt tokens each gets.
 *
 * Every running row decodes one token per step; what is left of the step's token budget goes to
 * prompt chunks, first to prompts already being prefilled (oldest first), then to newcomers in
 * arrival order. A prompt is cut at the same places whatever else runs ({@link nextPiece}): a piece
 * waits for a step with room for all of it instead of taking what the decode rows leave, so the
 * calls that prefill it, and with them its logprobs to the last bit, do not depend on the batch. A newcomer is admitted only while the batch has a free row and the KV cache can
 * hold the worst case of every admitted request: the batch is left-padded to its longest row, so
 * the worst case is rows × the longest reservation. The queue is strictly FIFO (no request jumps
 * an older one that does not fit), so a large request cannot starve. No running request is ever
 * preempted: what was admitted always fits.
 */
export class Scheduler<G extends SchedulableGroup> {
  readonly #limits: SchedulerLimits;
  readonly #waiting: G[] = [];
  readonly #prefilling: G[] = [];
  readonly #running: G[] = [];

  constructor(limits: SchedulerLimits) {
    this.#limits = limits;
  }

  get waiting(): readonly G[] {
    return this.#waiting;
  }

  get prefilling(): readonly G[] {
    return this.#prefilling;
  }

  get running(): readonly G[] {
    return this.#running;
  }

  enqueue(group: G): void {
    this.#waiting.push(group);
  }

  /** Moves a group whose prompt is fully prefilled to the decoding set. */
  markPrefilled(group: G): void {
    if (remove(this.#prefilling, group)) this.#running.push(group);
  }

  /** Forgets a finished or aborted group, wherever it is. */
  remove(group: G): void {
    if (!remove(this.#waiting, group) && !remove(this.#prefilling, group)) remove(this.#running, group);
  }

  /** @param promptBudget the most prompt tokens this plan may take (the step's budget minus its decode rows at most) */
  plan(promptBudget = Number.POSITIVE_INFINITY): StepPlan<G> {
    const { maxBatchSize, maxStepTokens, maxCachedTokens } = this.#limits;
    // A prefilling group holds a row: at most maxBatchSize − 1 rows decode beside it, so a piece of
    // this length always fits the oldest prefilling prompt's step. Below MIN_FIXED_PIECE (a step budget
    // close to the batch size) pieces that small would make a long prompt's prefill take a step per
    // few tokens even on an idle engine: prompts then take what the step leaves, as they used to.
    const piece = maxStepTokens - maxBatchSize + 1;
    const cut = (remaining: number, budget: number) =>
      piece >= MIN_FIXED_PIECE ? nextPiece(remaining, piece) : chunkLength(remaining, budget, maxStepTokens);
    let decodeRows = 0;
    for (const group of this.#running) decodeRows += group.rows;
    let budget = Math.min(maxStepTokens - decodeRows, promptBudget);
    const prefill: Array<PrefillChunk<G>> = [];
    for (const group of this.#prefilling) {
      const length = cut(group.promptLength - group.prefilled, budget);
      if (length === 0 || length > budget) break;
      prefill.push({ group, start: group.prefilled, length });
      budget -= length;
    }

    let rows = decodeRows;
    let longest = 0;
    for (const group of this.#prefilling) rows += group.rows;
    for (const group of [...this.#running, ...this.#prefilling]) longest = Math.max(longest, group.reservedLength);
    const admitted: G[] = [];
    while (budget > 0) {
      const next = this.#waiting[0];
      if (next === undefined) break;
      const nextRows = rows + next.rows;
      const nextLongest = Math.max(longest, next.reservedLength);
      if (nextRows > maxBatchSize || nextRows * nextLongest > maxCachedTokens) break;
      const length = cut(next.promptLength, budget);
      if (length === 0 || length > budget) break;
      this.#waiting.shift();
      this.#prefilling.push(next);
      admitted.push(next);
      rows = nextRows;
      longest = nextLongest;
      prefill.push({ group: next, start: 0, length });
      budget -= length;
    }
    return { admitted, prefill, decodeRows };
  }
}

/**
 * The next piece of a prompt with `remaining` tokens left to prefill, pieces of `piece` tokens: all
 * of them when they fit one piece, else one piece — one token shorter when that would leave a single
 * token, so that no piece of a longer prompt is one token (onnxruntime's GroupQueryAttention computes a
 * one-token call on its decode path, whose keys and values differ in the last bits from a longer
 * call's). A function of the prompt alone: the same cuts in any batch (docs/engine.md, "Batch
 * invariance"; they used to follow the budget the decode rows left, and so did the logprobs).
 */
function nextPiece(remaining: number, piece: number): number {
  if (remaining <= piece) return remaining;
  return remaining - piece === 1 ? piece - 1 : piece;
}

/**
 * The fewest tokens a fixed piece has: below it (`maxStepTokens − maxBatchSize + 1` smaller), prompts
 * are cut by what each step leaves ({@link chunkLength}), and their last bits may depend on the batch.
 */
const MIN_FIXED_PIECE = 16;

/**
 * With a step budget close to the batch size: how many of a prompt's `remaining` tokens a step with
 * `budget` left prefills — all that fit, but no one-token piece of a longer prompt, neither as the cut
 * nor as the rest it leaves (0: it waits for a budget of two). A step budget below two allows nothing else.
 */
function chunkLength(remaining: number, budget: number, maxStepTokens: number): number {
  if (remaining <= budget) return remaining;
  if (maxStepTokens < 2) return Math.max(0, budget);
  const length = remaining - budget === 1 ? budget - 1 : budget;
  return length >= 2 ? length : 0;
}

function remove<T>(list: T[], item: T): boolean {
  const at = list.indexOf(item);
  if (at < 0) return false;
  list.splice(at, 1);
  return true;
}
