import { TextStreamer, type ModelDir } from '@sluice/model';
import { EngineError } from './engine-error.js';
import { KvBatch, type KvRowSource } from './kv-batch.js';
import { LaneKv } from './kv-lane.js';
import type { OnnxSession } from './onnx-session.js';
import { packInputs, packLaneInputs, packPrompts, type RowInput } from './pack-inputs.js';
import { exactLengthLanes, planLanes } from './plan-lanes.js';
import { RequestGroup, type Sequence } from './request-group.js';
import type { ResolvedRequest } from './resolve-request.js';
import { Scheduler, type PrefillChunk, type SchedulerLimits, type StepPlan } from './scheduler.js';
import { PositionedRandom } from './seeded-random.js';
import { TokenSampler, type SampledToken } from './token-sampler.js';
import type {
  ContinuationMode,
  EarlyFirstTokens,
  EngineErrorCode,
  KvGrowth,
  EngineEvent,
  FinishReason,
  StepStats,
  TokenLogprob,
} from './types.js';

/** Absolute milliseconds, comparable between threads. */
export function now(): number {
  return performance.timeOrigin + performance.now();
}

export interface EngineCoreOptions extends SchedulerLimits {
  /** Fixed cost of one model call in padded KV slots (see {@link planLanes}). */
  laneCost: number;
  /** Batch only rows of equal length (graphs with GroupQueryAttention cannot express padding). */
  exactLengthBatches: boolean;
  /** See {@link EngineOptions.continuationMode}. */
  continuationMode: ContinuationMode;
  /** See {@link EngineOptions.kvGrowth}. */
  kvGrowth: KvGrowth;
  /** See {@link EngineOptions.kvPreallocate}. */
  kvPreallocate?: boolean;
  /** See {@link EngineOptions.maxPrefillBatch}. */
  maxPrefillBatch: number;
  /** See {@link EngineOptions.earlyFirstTokens}. */
  earlyFirstTokens: EarlyFirstTokens;
}

/**
 * Left padding a call of prompts prefilled together may add, as a share of its real tokens: prompts
 * are grouped by length, and a call closes before its padding would pass this.
 */
const PREFILL_PADDING_SHARE = 1 / 8;

export interface StepOutput {
  events: Array<[key: number, event: EngineEvent]>;
  stats?: StepStats;
}

/**
 * The engine's step loop without the thread: requests in, one batch of events out per `step()`.
 *
 * A step: end aborted requests; plan (scheduler); repack the lanes if rows left or joined; one
 * decode call per lane (every running row gets one token); one call per prompt chunk (newcomers and
 * long prompts being prefilled); sample each row with its own sampler; detokenize; check stops.
 * Prompts that finished prefill join a lane at the next step's repack. Prefill and decode run as
 * separate calls rather than one ragged call: see docs/engine.md for the measurement.
 */
export class EngineCore {
  readonly #session: OnnxSession;
  readonly #model: ModelDir;
  readonly #limits: EngineCoreOptions;
  readonly #scheduler: Scheduler<RequestGroup>;
  readonly #groups = new Map<number, RequestGroup>();
  readonly #aborts = new Set<number>();
  readonly #eos: ReadonlySet<number>;
  readonly #padTokenId: number;
  readonly #tokenText = new Map<number, string>();
  readonly #tokenBytes = new Map<number, number[]>();
  /** The decode rows, split into lanes of similar length (one model call each). */
  #lanes: Lane[] = [];
  /**
   * The engine-owned lane while no row decodes: kept, with its buffers, for the next rows. A fresh
   * lane faults its buffers' pages in as rows are written (~30 ms for 32 rows of the bench model, in
   * the step they join); a kept one is warm. Servers reserve KV memory up front for the same reason.
   */
  #idleLane: Lane | undefined;
  readonly #laneCost: number;
  readonly #exactLengthBatches: boolean;
  /** Sequences whose prompt finished prefill, with the cache row they will copy in. */
  #joining: Array<{ sequence: Sequence; source: KvRowSource }> = [];
  #events: Array<[number, EngineEvent]> = [];

  /** Bytes of KV cache reserved and written at start (`kvPreallocate`); 0 without it. */
  readonly kvReservedBytes: number = 0;

  constructor(session: OnnxSession, model: ModelDir, limits: EngineCoreOptions) {
    this.#session = session;
    this.#model = model;
    this.#limits = limits;
    this.#scheduler = new Scheduler(limits);
    this.#eos = new Set(model.generation.eosTokenIds);
    this.#padTokenId = model.generation.padTokenId ?? model.generation.eosTokenIds[0] ?? 0;
    this.#laneCost = limits.laneCost;
    this.#exactLengthBatches = limits.exactLengthBatches;
    if (limits.kvPreallocate === true && session.outputsNewKv) {
      const lane = this.#newLane();
      this.kvReservedBytes = (lane.batch as LaneKv).preallocate(model.generation.maxContextLength, limits.maxCachedTokens);
      this.#idleLane = lane;
    }
  }

  /** True when there is nothing to run. */
  get idle(): boolean {
    return this.#groups.size === 0;
  }

  /** KV slots held now, padding included. */
  get cachedTokens(): number {
    let slots = 0;
    for (const lane of this.#lanes) slots += lane.batch.slotCount;
    for (const group of this.#groups.values()) slots += group.prefillKv?.slotCount ?? 0;
    return slots;
  }

  add(key: number, request: ResolvedRequest, submittedAt: number): void {
    const group = new RequestGroup(key, request, submittedAt, this.#limits.continuationMode);
    this.#groups.set(key, group);
    this.#scheduler.enqueue(group);
  }

  /** Ends the request at the next step boundary with finish reason 'abort'. */
  abort(key: number): void {
    if (this.#groups.has(key)) this.#aborts.add(key);
  }

  /** Ends every request (engine closing) and returns their last events. */
  failAll(code: EngineErrorCode, message: string): StepOutput {
    for (const group of [...this.#groups.values()]) this.#failGroup(group, code, message);
    this.#lanes = [];
    this.#idleLane = undefined;
    this.#joining = [];
    return { events: this.#takeEvents() };
  }

  /**
   * One step: the step's prompt chunks, then one decode call per lane, the prompts that just
   * completed among its rows. With `early`, events leave before the step's first prompt chunk's model
   * call instead of with the step's output (the newcomers' `scheduled` events); with
   * `earlyFirstTokens` true (the default) before each later call too, the decode included, so each
   * prompt's first token leaves as its own prefill ends; with `'after-prefills'` once more, before the
   * decode, so the step's first tokens leave together when its last prefill call ends.
   */
  async step(early?: (events: StepOutput['events']) => void): Promise<StepOutput> {
    const startedAt = now();
    const relayoutsBefore = this.#relayouts();
    for (const key of this.#aborts) {
      const group = this.#groups.get(key);
      if (group !== undefined) this.#endGroup(group, 'abort');
    }
    this.#aborts.clear();

    const plan = this.#scheduler.plan();
    this.#scheduled(plan.admitted, startedAt);
    // Prompt chunks the step takes: its plan's, and those a step holding its first tokens takes in.
    const planned = { chunks: plan.prefill.length };
    let modelMs = 0;
    let generationTokens = 0;
    let promptTokens = 0;
    let prefillCalls = 0;
    let promptChunks = 0;
    const handOver = (): void => {
      if (early !== undefined && this.#events.length > 0) early(this.#takeEvents());
    };
    const firstTokens = this.#limits.earlyFirstTokens;
    // Prompts first, then the decode with the prompts just prefilled in it: a newcomer's first token
    // leaves when its own prefill ends (within the step in progress when it came, plus that prefill),
    // and its second with this step's decode. A running row's tokens are as far apart either way: the
    // step's prefills sit between two of them, before or after its decode call.
    for (const call of this.#stepCalls(plan, planned)) {
      const chunks = call.filter((chunk) => !chunk.group.finished);
      if (chunks.length === 0) continue;
      prefillCalls++;
      if (prefillCalls === 1 || firstTokens === true) handOver();
      const runStart = now();
      try {
        generationTokens += chunks.length === 1 ? await this.#prefill(chunks[0]!) : await this.#prefillTogether(chunks);
        for (const chunk of chunks) promptTokens += chunk.length;
        promptChunks += chunks.length;
      } catch (cause) {
        for (const chunk of chunks) this.#failGroup(chunk.group, 'internal', `Prefill failed: ${errorText(cause)}`);
      }
      modelMs += now() - runStart;
    }
    if (prefillCalls > 0 && firstTokens !== false) handOver();

    // Prompts of this step that now decode in it too count once in the batch.
    const joinedGroups =
      this.#joining.length === 0
        ? 0
        : new Set(this.#joining.filter(({ sequence }) => sequence.finishReason === undefined).map(({ sequence }) => sequence.group)).size;
    this.#repack();
    let decodeRows = 0;
    for (const lane of this.#lanes) {
      decodeRows += lane.rows.length;
      const runStart = now();
      try {
        generationTokens += await this.#decode(lane);
      } catch (cause) {
        for (const sequence of lane.rows) this.#failGroup(sequence.group, 'internal', `Decode step failed: ${errorText(cause)}`);
      }
      modelMs += now() - runStart;
    }

    // A lane with no live row left frees its memory now, not at the next step (which may never come).
    this.#lanes = this.#lanes.filter((lane) => {
      if (lane.rows.some((sequence) => sequence.finishReason === undefined)) return true;
      if (lane.batch instanceof LaneKv) this.#idleLane = lane;
      return false;
    });

    const ranModel = decodeRows > 0 || planned.chunks > 0;
    const output: StepOutput = { events: this.#takeEvents() };
    if (ranModel || output.events.length > 0) {
      output.stats = {
        // A step that only ended aborted requests ran no model: it reports batchSize 0 as 'decode'.
        phase: decodeRows === 0 && planned.chunks > 0 ? 'prefill' : planned.chunks === 0 ? 'decode' : 'mixed',
        batchSize: decodeRows + planned.chunks - joinedGroups,
        stepTokens: decodeRows + promptTokens,
        stepMs: now() - startedAt,
        modelMs,
        // Requests, as vLLM counts them (a prompt being prefilled is running).
        running: this.#scheduler.prefilling.length + this.#scheduler.running.length,
        waiting: this.#scheduler.waiting.length,
        cachedTokens: this.cachedTokens,
        maxCachedTokens: this.#limits.maxCachedTokens,
        promptTokens,
        prefillCalls,
        promptChunks,
        generationTokens,
        kvRelayouts: this.#relayouts() - relayoutsBefore,
      };
    }
    return output;
  }

  /** Groups admitted to the batch at `at`: each one's `scheduled` event. */
  #scheduled(groups: readonly RequestGroup[], at: number): void {
    for (const group of groups) {
      group.scheduledAt = at;
      this.#events.push([group.key, { type: 'scheduled' }]);
    }
  }

  /**
   * The step's prefill calls: its plan's, then, in a step that holds its first tokens back
   * (`earlyFirstTokens` not true), the prompts that arrived while they ran, planned anew after each
   * round of calls (up to one more step budget of prompt tokens in all) as long as the rows whose
   * first token it holds outnumber the rows that were decoding when it began. A burst that reaches
   * the engine over several steps (one request at a time through the gateway and the queue) is then
   * prefilled in one, its first tokens leave together and its rows decode together from then on, as
   * if it had come at once; without it the burst's first rows take their first tokens, then wait
   * through the late arrivals' prefills in the next step, an inter-token gap of the whole prefill.
   * A newcomer joining a batch that is decoding is never held for others (docs/engine.md, "A step").
   * Each round is planned when the previous one's calls are done (a generator: the caller awaits each
   * call before asking for the next). `planned.chunks` counts the chunks planned anew.
   */
  *#stepCalls(plan: StepPlan<RequestGroup>, planned: { chunks: number }): Generator<Array<PrefillChunk<RequestGroup>>> {
    if (this.#limits.earlyFirstTokens === true) {
      yield* this.#prefillCalls(plan.prefill);
      return;
    }
    let round = plan.prefill;
    let budget = this.#limits.maxStepTokens;
    let heldRows = 0;
    for (;;) {
      for (const call of this.#prefillCalls(round)) {
        yield call;
        for (const { group, start, length } of call) if (!group.finished && start + length === group.promptLength) heldRows += group.rows;
      }
      if (budget <= 0 || heldRows <= plan.decodeRows || this.#scheduler.waiting.length === 0) return;
      const more = this.#scheduler.plan(budget);
      if (more.prefill.length === 0) return;
      this.#scheduled(more.admitted, now());
      for (const chunk of more.prefill) budget -= chunk.length;
      planned.chunks += more.prefill.length;
      round = more.prefill;
    }
  }

  /** One decode token for every row of a lane: new slices written into its LaneKv, or (fallback) its present tensors become its next past. */
  async #decode(lane: Lane): Promise<number> {
    const { rows, batch } = lane;
    if (batch instanceof LaneKv) {
      // Engine-owned cache: fetch only logits and the new slices, written into each row's next slot.
      batch.reserveNext(this.#laneLimit(rows));
      const inputs = packLaneInputs(
        batch.capacity,
        rows.map((sequence, row) => ({ cachedLength: batch.lengths[row]!, token: lastToken(sequence) })),
      );
      const output = await this.#session.runNewKv(inputs, batch);
      batch.append(output.newKv);
      return this.#sampleRows(rows, output);
    }
    const inputs = packInputs(
      batch.pastLength,
      rows.map((sequence, row) => ({ cachedLength: batch.lengths[row]!, tokens: [lastToken(sequence)] })),
      this.#padTokenId,
    );
    const output = await this.#session.run(inputs, batch);
    lane.batch = batch.appended(
      output.present,
      1,
      rows.map(() => 1),
    );
    return this.#sampleRows(rows, output);
  }

  /**
   * Samples each row's next token from the last logit position of its row (a row still replaying
   * a continuation's tokens draws nothing: its next token is known). Returns the tokens sampled.
   */
  #sampleRows(rows: readonly Sequence[], output: { logits: Float32Array; positions: number; vocabSize: number }): number {
    let sampled = 0;
    rows.forEach((sequence, row) => {
      if (sequence.replay > 0) {
        sequence.replay -= 1;
        return;
      }
      const offset = (row * output.positions + output.positions - 1) * output.vocabSize;
      this.#accept(sequence, sequence.sampler.sample(output.logits, offset, output.vocabSize));
      sampled += 1;
    });
    return sampled;
  }

  /** Feeds one prompt chunk; when it completes the prompt, samples each sibling's first token. */
  async #prefill(chunk: PrefillChunk<RequestGroup>): Promise<number> {
    const { group, start, length } = chunk;
    const prompt = group.prefillTokenIds;
    const past = group.prefillKv ?? KvBatch.empty(this.#session.io.kv, 1);
    const row: RowInput = { cachedLength: group.prefilled, tokens: prompt.slice(start, start + length) };
    const inputs = packInputs(past.pastLength, [row], this.#padTokenId);
    let output: { logits: Float32Array; positions: number; vocabSize: number };
    if (this.#session.outputsNewKv) {
      const run = await this.#session.runNewKv(inputs, past);
      group.prefillKv = past.appendedNew(run.newKv, length);
      output = run;
    } else {
      const run = await this.#session.run(inputs, past);
      group.prefillKv = past.appended(run.present, length, [length]);
      output = run;
    }
    group.prefilled += length;
    if (group.prefilled < group.promptLength) return 0;
    return this.#prefilled(group, output.logits, (output.positions - 1) * output.vocabSize, output.vocabSize);
  }

  /**
   * The step's prompt chunks as model calls, in order. Whole prompts with nothing cached yet are
   * prefilled together, up to `maxPrefillBatch` a call (a batch-1 prefill call reads all the weights
   * for a few tokens: docs/engine.md, "Prefilling a burst"): shortest first, each call right-padded to
   * its longest prompt and closed before that padding passes {@link PREFILL_PADDING_SHARE} of its
   * tokens. A long prompt's chunks, and every chunk of a graph whose logits are not read at each row's
   * last real token (GroupQueryAttention, which cannot take padding, among them), go one a call, first.
   */
  #prefillCalls(chunks: ReadonlyArray<PrefillChunk<RequestGroup>>): Array<Array<PrefillChunk<RequestGroup>>> {
    const max = this.#limits.maxPrefillBatch;
    // A chunk from position 0 to the prompt's end is a whole prompt with nothing cached.
    const together = new Set(
      max > 1 && this.#session.outputsNewKv && this.#session.lastRealTokenLogits && !this.#exactLengthBatches
        ? chunks.filter((chunk) => chunk.start === 0 && chunk.length === chunk.group.promptLength)
        : [],
    );
    if (together.size < 2) return chunks.map((chunk) => [chunk]);
    const calls = chunks.filter((chunk) => !together.has(chunk)).map((chunk) => [chunk]);
    let call: Array<PrefillChunk<RequestGroup>> = [];
    let tokens = 0;
    for (const chunk of [...together].sort((a, b) => a.length - b.length)) {
      const padded = chunk.length * (call.length + 1);
      if (call.length > 0 && (call.length >= max || padded > (tokens + chunk.length) * (1 + PREFILL_PADDING_SHARE))) {
        calls.push(call);
        call = [];
        tokens = 0;
      }
      call.push(chunk);
      tokens += chunk.length;
    }
    calls.push(call);
    return calls;
  }

  /**
   * Whole prompts, nothing cached yet, in one call (right-padded to the longest: each row's numbers
   * are then the ones a call of its own gives, to the bit); samples each one's first tokens.
   */
  async #prefillTogether(chunks: ReadonlyArray<PrefillChunk<RequestGroup>>): Promise<number> {
    const shape = this.#session.io.kv;
    const inputs = packPrompts(
      chunks.map(({ group, length }) => group.prefillTokenIds.slice(0, length)),
      this.#padTokenId,
    );
    const run = await this.#session.runNewKv(inputs, KvBatch.empty(shape, chunks.length));
    const slots = inputs.newTokens;
    let sampled = 0;
    chunks.forEach(({ group, length }, row) => {
      // The prompt's own slots (the first `length` of its row), compact, as a call of its own leaves them.
      group.prefillKv = KvBatch.gather(shape, [{ data: run.newKv, slots, row, segments: [[0, length]] }]);
      group.prefilled += length;
      sampled += this.#prefilled(group, run.logits, (row * run.positions + run.positions - 1) * run.vocabSize, run.vocabSize);
    });
    return sampled;
  }

  /**
   * A group's prompt is in its cache: its sequences start, each sibling's first token sampled from
   * the logits row at `offset`. @returns the tokens sampled
   */
  #prefilled(group: RequestGroup, logits: Float32Array, offset: number, vocabSize: number): number {
    group.prefilledAt = now();
    this.#scheduler.markPrefilled(group);
    const { sampling, continuation } = group.request;
    const promptTokens = new Set(group.request.promptTokenIds);
    const seed = sampling.seed ?? crypto.getRandomValues(new Uint32Array(1))[0]!;
    const source = group.prefillKv!.rowSource(0);
    for (let index = 0; index < sampling.n; index++) {
      const choice = continuation?.choiceIndex ?? index;
      const generated = continuation?.generatedTokenIds ?? [];
      const random = new PositionedRandom(seed, choice, generated.length);
      const sequence: Sequence = {
        group,
        index: choice,
        sampler: new TokenSampler(sampling, promptTokens, random),
        streamer: new TextStreamer(this.#model.tokenizer, { stop: sampling.stop }),
        outputTokenIds: [...generated],
        replay: group.replays ? generated.length - 1 : 0,
        finishReason: undefined,
      };
      // A continuation: its sampler, detokenizer and stop window see the tokens already sent, as the
      // original run's did; their text is not emitted again. Replayed, its first generated token is
      // already known (no draw from the prompt's logits) and the rest follow by decode steps.
      sequence.sampler.prime(generated);
      for (const tokenId of generated) sequence.streamer.push(tokenId);
      group.sequences.push(sequence);
    }
    // Every sibling is in the group before any samples: one that ends on its first token (max_tokens 1,
    // a stop, EOS) must not finish the group while its siblings are still to come.
    for (const sequence of group.sequences) {
      if (!group.replays) this.#accept(sequence, sequence.sampler.sample(logits, offset, vocabSize));
      if (sequence.finishReason === undefined) this.#joining.push({ sequence, source });
    }
    return group.replays ? 0 : sampling.n;
  }

  /** Records a sampled token: detokenize, emit, and end the sequence if a stop condition holds. */
  #accept(sequence: Sequence, sampled: SampledToken): void {
    const { group } = sequence;
    const { sampling } = group.request;
    const tokenId = sampled.tokenId;
    sequence.outputTokenIds.push(tokenId);
    group.firstTokenAt ??= now();

    const produced = sequence.outputTokenIds.length;
    let text = '';
    let finishReason: FinishReason | undefined;
    if (sampling.stopTokenIds.includes(tokenId) || (!sampling.ignoreEos && this.#eos.has(tokenId))) {
      // As vLLM: a stop token counts as a completion token, but its text is never emitted (it need
      // not be a special token); only the text held back before it is flushed.
      finishReason = 'stop';
      text = sequence.streamer.finish().text;
    } else {
      const delta = sequence.streamer.push(tokenId);
      text = delta.text;
      finishReason = delta.finishReason;
      if (finishReason === undefined) {
        if (produced >= sampling.maxTokens || group.request.promptTokenIds.length + produced >= this.#model.generation.maxContextLength) {
          finishReason = 'length';
        }
        if (finishReason !== undefined) text += sequence.streamer.finish().text;
      }
    }
    const event: EngineEvent = { type: 'text-delta', index: sequence.index, tokenIds: [tokenId], text };
    if (sampling.logprobs) event.logprobs = [this.#logprob(sampled)];
    this.#events.push([group.key, event]);
    if (finishReason !== undefined) this.#endSequence(sequence, finishReason);
  }

  #logprob(sampled: SampledToken): TokenLogprob {
    const logprob: TokenLogprob = {
      tokenId: sampled.tokenId,
      token: this.#text(sampled.tokenId),
      logprob: sampled.logprob ?? 0,
    };
    const bytes = this.#bytes(sampled.tokenId);
    if (bytes !== undefined) logprob.bytes = bytes;
    if (sampled.topLogprobs !== undefined) {
      logprob.topLogprobs = sampled.topLogprobs.map((top) => {
        const topBytes = this.#bytes(top.tokenId);
        return { ...top, token: this.#text(top.tokenId), ...(topBytes === undefined ? {} : { bytes: topBytes }) };
      });
    }
    return logprob;
  }

  /** The vocabulary bytes of a token (logprobs `bytes`), cached like its text. */
  #bytes(tokenId: number): number[] | undefined {
    let bytes = this.#tokenBytes.get(tokenId);
    if (bytes === undefined) {
      bytes = this.#model.tokenizer.tokenBytes?.(tokenId);
      if (bytes === undefined) return undefined;
      this.#tokenBytes.set(tokenId, bytes);
    }
    return bytes;
  }

  #text(tokenId: number): string {
    let text = this.#tokenText.get(tokenId);
    if (text === undefined) {
      text = this.#model.tokenizer.decode([tokenId], { skipSpecialTokens: false });
      this.#tokenText.set(tokenId, text);
    }
    return text;
  }

  #endSequence(sequence: Sequence, reason: FinishReason, error?: { code: EngineErrorCode; message: string }): void {
    if (sequence.finishReason !== undefined) return;
    sequence.finishReason = reason;
    const { group } = sequence;
    this.#events.push([group.key, { type: 'text-end', index: sequence.index, finishReason: reason }]);
    if (group.sequences.every((sibling) => sibling.finishReason !== undefined)) this.#finishGroup(group, error);
  }

  /** Ends every live choice of the group (also those not started yet) with `reason`. */
  #endGroup(group: RequestGroup, reason: FinishReason, error?: { code: EngineErrorCode; message: string }): void {
    if (group.finished) return;
    if (group.sequences.length === 0) {
      for (let index = 0; index < group.request.sampling.n; index++) {
        this.#events.push([group.key, { type: 'text-end', index: group.request.continuation?.choiceIndex ?? index, finishReason: reason }]);
      }
      this.#finishGroup(group, error);
      return;
    }
    for (const sequence of group.sequences) this.#endSequence(sequence, reason, error);
  }

  #failGroup(group: RequestGroup, code: EngineErrorCode, message: string): void {
    this.#endGroup(group, 'error', { code, message });
  }

  #finishGroup(group: RequestGroup, error?: { code: EngineErrorCode; message: string }): void {
    group.finished = true;
    group.prefillKv = undefined;
    this.#groups.delete(group.key);
    this.#scheduler.remove(group);
    const finish: EngineEvent = {
      type: 'finish',
      usage: { promptTokens: group.request.promptTokenIds.length, completionTokens: group.completionTokens },
      timings: group.timings(now()),
    };
    if (error !== undefined) finish.error = error;
    this.#events.push([group.key, finish]);
  }

  /**
   * Drops finished rows, brings joiners in and re-splits the rows into lanes by length
   * ({@link planLanes}). Nothing is copied when no row left or joined; a lane whose rows are
   * unchanged is kept as it is; every other lane is gathered (one copy of its rows).
   */
  #repack(): void {
    const joining = this.#joining.filter(({ sequence }) => sequence.finishReason === undefined);
    this.#joining = [];
    const isLive = (sequence: Sequence): boolean => sequence.finishReason === undefined;
    if (joining.length === 0 && this.#lanes.every((lane) => lane.rows.every(isLive))) return;
    if (this.#session.outputsNewKv) {
      this.#repackOwned(joining, isLive);
      return;
    }

    const entries: LaneEntry[] = [];
    for (const lane of this.#lanes) {
      lane.rows.forEach((sequence, row) => {
        if (isLive(sequence)) entries.push({ sequence, length: lane.batch.lengths[row]!, source: lane.batch.rowSource(row), lane });
      });
    }
    for (const { sequence, source } of joining) {
      entries.push({ sequence, length: source.segments.reduce((sum, [, length]) => sum + length, 0), source, lane: undefined });
    }
    entries.sort((a, b) => a.length - b.length);
    const lengths = entries.map((entry) => entry.length);
    const sizes = this.#exactLengthBatches ? exactLengthLanes(lengths) : planLanes(lengths, this.#laneCost);

    const lanes: Lane[] = [];
    let at = 0;
    for (const size of sizes) {
      const group = entries.slice(at, at + size);
      at += size;
      const old = group[0]!.lane;
      if (old !== undefined && old.rows.length === size && group.every((entry) => entry.lane === old)) {
        lanes.push(old);
      } else {
        lanes.push({
          rows: group.map((entry) => entry.sequence),
          batch: KvBatch.gather(
            this.#session.io.kv,
            group.map((entry) => entry.source),
          ),
        });
      }
    }
    this.#lanes = lanes;
    for (const { sequence } of joining) sequence.group.prefillKv = undefined;
  }

  /**
   * The repack with an engine-owned cache: one lane, changed in place. Leaving rows are replaced by
   * the last row and joining rows appended, so only those rows are copied. (Splitting into lanes by
   * length, as {@link planLanes} does for the present.* path, would copy every moved row; with the
   * copy-out gone a padded slot costs little, so one lane is kept.)
   */
  #repackOwned(joining: ReadonlyArray<{ sequence: Sequence; source: KvRowSource }>, isLive: (sequence: Sequence) => boolean): void {
    const lane = this.#lanes[0] ?? this.#idleLane ?? this.#newLane();
    this.#idleLane = undefined;
    const kv = lane.batch;
    if (!(kv instanceof LaneKv) || this.#lanes.length > 1) throw new EngineError('internal', 'Expected one engine-owned lane.');
    for (let row = lane.rows.length - 1; row >= 0; row--) {
      if (isLive(lane.rows[row]!)) continue;
      kv.removeRow(row);
      lane.rows[row] = lane.rows[lane.rows.length - 1]!;
      lane.rows.pop();
    }
    // One limit for the whole repack, joiners included: the first row's allocation then makes room
    // for every row joining with it, instead of a reallocation (a copy of the whole cache into fresh
    // pages, ~70 ms at 32 rows × 128 slots of the bench model) when a longer reservation joins later.
    const limit = this.#laneLimit([...lane.rows, ...joining.map(({ sequence }) => sequence)]);
    for (const { sequence, source } of joining) {
      lane.rows.push(sequence);
      kv.addRow(source, limit);
      sequence.group.prefillKv = undefined;
    }
    this.#lanes = lane.rows.length > 0 ? [lane] : [];
    if (lane.rows.length === 0) this.#idleLane = lane;
  }

  /** Whole-lane copies the engine-owned lane has made so far (there is at most one: running or idle). */
  #relayouts(): number {
    const batch = (this.#lanes[0] ?? this.#idleLane)?.batch;
    return batch instanceof LaneKv ? batch.relayouts : 0;
  }

  /** An empty engine-owned lane, for up to maxBatchSize rows. */
  #newLane(): Lane {
    return { rows: [], batch: new LaneKv(this.#session.io.kv, this.#limits.maxBatchSize, this.#limits.kvGrowth) };
  }

  /** The most slots any of these rows' caches can need. */
  #laneLimit(rows: readonly Sequence[]): number {
    let limit = 0;
    for (const sequence of rows) limit = Math.max(limit, this.#reservation(sequence));
    return limit;
  }

  /** The most slots a sequence's cache can need: prompt + maxTokens, within the context length. */
  #reservation(sequence: Sequence): number {
    const { group } = sequence;
    return Math.min(group.request.promptTokenIds.length + group.request.sampling.maxTokens, this.#model.generation.maxContextLength);
  }

  #takeEvents(): Array<[number, EngineEvent]> {
    const events = this.#events;
    this.#events = [];
    return events;
  }
}

/**
 * Rows decoded together in one model call, and their cache: engine-owned ({@link LaneKv}) when the
 * session outputs new key/value slices, else the left-padded `present.*` of the last call.
 */
interface Lane {
  rows: Sequence[];
  batch: KvBatch | LaneKv;
}

interface LaneEntry {
  sequence: Sequence;
  length: number;
  source: KvRowSource;
  lane: Lane | undefined;
}

/** The token a decode step feeds for the sequence: its last, or the next one it replays. */
function lastToken(sequence: Sequence): number {
  const token = sequence.outputTokenIds[sequence.outputTokenIds.length - 1 - sequence.replay];
  if (token === undefined) throw new EngineError('internal', 'A decoding sequence has no token yet.');
  return token;
}

function errorText(cause: unknown): string {
  return cause instanceof Error ? cause.message : String(cause);
}
