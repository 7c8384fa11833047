import type { TextStreamer } from '@sluice/model';
import type { KvBatch } from './kv-batch.js';
import type { ResolvedRequest } from './resolve-request.js';
import type { SchedulableGroup } from './scheduler.js';
import type { TokenSampler } from './token-sampler.js';
import type { ContinuationMode, FinishReason, RequestTimings } from './types.js';

/** One choice of a request: a row of the decode batch once its prompt is prefilled. */
export interface Sequence {
  readonly group: RequestGroup;
  readonly index: number;
  readonly sampler: TokenSampler;
  readonly streamer: TextStreamer;
  readonly outputTokenIds: number[];
  /**
   * A continuation's generated tokens still to be fed before the next draw, beyond the one every
   * decode step feeds: they go through the cache one decode step each, as the original run fed
   * them, so the cache and the next logits are the original's bit for bit (prefilling them would
   * sum in another order). 0 once caught up.
   */
  replay: number;
  finishReason: FinishReason | undefined;
}

/**
 * A request inside the engine: its prompt, its progress through prefill, and its n sibling
 * sequences once the prompt is in the cache.
 */
export class RequestGroup implements SchedulableGroup {
  readonly key: number;
  readonly request: ResolvedRequest;
  readonly submittedAt: number;
  readonly reservedLength: number;
  prefilled = 0;
  /** The prompt's own one-row cache while it is prefilled in chunks; siblings copy it when they join. */
  prefillKv: KvBatch | undefined;
  sequences: Sequence[] = [];
  scheduledAt: number | undefined;
  prefilledAt: number | undefined;
  firstTokenAt: number | undefined;
  finished = false;

  /** What is prefilled: the prompt, and a continuation's generated tokens unless they are replayed. */
  readonly prefillTokenIds: readonly number[];
  /** A continuation's generated tokens are fed by decode steps (see {@link Sequence.replay}). */
  readonly replays: boolean;

  constructor(key: number, request: ResolvedRequest, submittedAt: number, continuationMode: ContinuationMode = 'replay') {
    this.key = key;
    this.request = request;
    this.submittedAt = submittedAt;
    this.reservedLength = request.promptTokenIds.length + request.sampling.maxTokens;
    const generated = request.continuation?.generatedTokenIds ?? [];
    this.replays = generated.length > 0 && continuationMode === 'replay';
    this.prefillTokenIds = generated.length === 0 || this.replays ? request.promptTokenIds : [...request.promptTokenIds, ...generated];
  }

  /** Tokens to prefill (the scheduler's prompt). */
  get promptLength(): number {
    return this.prefillTokenIds.length;
  }

  get rows(): number {
    if (this.sequences.length === 0) return this.request.sampling.n;
    let live = 0;
    for (const sequence of this.sequences) if (sequence.finishReason === undefined) live++;
    return live;
  }

  /** Its output so far: a continuation's generated tokens count from the start, before its prefill made sequences. */
  get completionTokens(): number {
    if (this.sequences.length === 0) return this.request.continuation?.generatedTokenIds.length ?? 0;
    let total = 0;
    for (const sequence of this.sequences) total += sequence.outputTokenIds.length;
    return total;
  }

  timings(now: number): RequestTimings {
    const scheduledAt = this.scheduledAt ?? now;
    return {
      queueMs: scheduledAt - this.submittedAt,
      prefillMs: this.prefilledAt === undefined ? 0 : this.prefilledAt - scheduledAt,
      firstTokenMs: this.firstTokenAt === undefined ? 0 : this.firstTokenAt - this.submittedAt,
    };
  }
}
