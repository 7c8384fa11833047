/**
 * Public types of the engine: one model, many concurrent requests, continuous batching.
 * The engine imports no Redis, BullMQ, HTTP or prom-client code: it yields numbers, callers record them.
 */

export type ExecutionProvider = 'cpu' | 'cuda' | 'webgpu';

/** Options of {@link createEngine}. */
/** {@link EngineOptions.intraOpSpinning}: always (onnxruntime's default), never, or only while a call runs. */
export type IntraOpSpinning = boolean | 'during-run';

/** When a step's first tokens leave: see {@link EngineOptions.earlyFirstTokens}. */
export type EarlyFirstTokens = boolean | 'after-prefills';

export interface EngineOptions {
  /** Model directory (Hugging Face / Optimum layout). */
  modelDir: string;
  /** Max sequences decoded together in one step. @defaultValue 32 */
  maxBatchSize?: number;
  /**
   * Max tokens (prefill chunk tokens + one per decoding sequence) fed to the model in one step. A prompt
   * that completes in a step also decodes in it (its second token), one token per sequence beyond this
   * budget. @defaultValue 512
   */
  maxStepTokens?: number;
  /** Cap on tokens held in the KV cache over all sequences; requests that do not fit wait. @defaultValue maxBatchSize × context length */
  maxCachedTokens?: number;
  /** onnxruntime execution provider. @defaultValue 'cpu' */
  executionProvider?: ExecutionProvider;
  /**
   * onnxruntime intra-op threads. 0: one per physical core this process may run on, counted from the
   * kernel's CPU topology (onnxruntime's own count, through cpuinfo, saw one core of two on this
   * project's VMs); onnxruntime's default where the topology cannot be read.
   * {@link EngineInfo.intraOpThreads} says what was used. @defaultValue 0
   */
  intraOpThreads?: number;
  /** onnxruntime inter-op threads (0 = onnxruntime's default). @defaultValue 0 */
  interOpThreads?: number;
  /**
   * Whether onnxruntime's intra-op threads spin while they wait for work. `true` (its default):
   * they spin between parallel sections and after a call, saving a wake-up per section (a batch-1
   * decode call has ~60) but holding the cores after the call, where the worker's host thread,
   * Redis and the gateway need them. `false` (`session.intra_op.allow_spinning` 0): they block.
   * `'during-run'` (`session.force_spinning_stop`): they spin while a call runs and stop when it
   * ends. Which is fastest depends on the machine (docs/engine.md "Spinning"); the worker's
   * `INTRA_OP_SPINNING` picks one.
   * @defaultValue true (onnxruntime's default)
   */
  intraOpSpinning?: IntraOpSpinning;
  /**
   * How a continuation ({@link GenerateRequest.continuation}) feeds its generated tokens:
   * `replay` — one decode step each, as the original run fed them, so the next logits are the
   * original's bit for bit (costs one step per generated token); `prefill` — with the prompt, in
   * one pass (one step; logits may differ from the original's in the last bits, ~1e-6).
   * @defaultValue 'replay'
   */
  continuationMode?: ContinuationMode;
  /**
   * How the decode rows' KV cache grows (engine-owned cache only): `in-place` — the whole cache is
   * moved in the step that needs the room (one latency spike per growth, 30–90 ms at 32 rows × 576
   * slots of the bench model); `spread` — the next, larger layout is copied into a second buffer set,
   * a share per step, before it is needed, so no step waits for a whole-cache copy. Spread costs up to
   * twice the KV memory and some throughput: measured, it lowered the bench model's 32 × 768 ITL p99
   * at the same tokens/s, but cost the SmolLM2-shaped model 4–12 % of its tokens/s with no ITL gain
   * (docs/engine.md).
   * @defaultValue 'in-place'
   */
  kvGrowth?: KvGrowth;
  /**
   * How a model's GroupQueryAttention (onnxruntime-genai's exports) runs: `decomposed` — the load-time
   * rewrite replaces it by the plain form's attention ops over the engine-owned cache, because the
   * operator copies every row's cache into its `present` outputs in every layer of every step
   * (measured on the bench model in that form: 2.3× the tokens/s at 32 × 768 and 1.6× at 32 × 128);
   * where the plain ops would compute something else (a sliding window, softcap, …) the operator
   * stays. Logits within 1e-4 of the operator's, the same greedy tokens. `op` — onnxruntime's
   * operator, which reads each row's real length only. Either way a request's numbers do not depend
   * on its batch, to the bit, on one engine; with `op` not on how its prompt was cut into pieces
   * either (engines with other step budgets), with `decomposed` they do (docs/engine.md, "Batch
   * invariance"). Other graphs are unaffected.
   * @defaultValue 'decomposed'
   */
  gqaAttention?: GqaAttention;
  /**
   * Reserve the KV cache at start (engine-owned cache only): allocate the decode lane's buffers for
   * `maxBatchSize` rows of the context length and write their first `maxCachedTokens` slots plus
   * 15 a row (a row's capacity may pass its reservation by that much: `KV_ALIGN` in `kv-lane.ts`;
   * all of them when the lane holds fewer), so the first burst after start does not fault its cache
   * in step by step (measured: the first decode step of 32 new rows of the bench model 205 ms, its
   * first growth 119 ms, vs ~20 ms warm). The price is that memory held from the start: up to
   * those slots × the model's KV bytes per slot (twice that with `kvGrowth: 'spread'`;
   * {@link EngineInfo.kvReservedBytes} says how much), as llama.cpp and vLLM reserve theirs.
   * @defaultValue false
   */
  kvPreallocate?: boolean;
  /**
   * Leave the weights of a model stored inside `model.onnx` in that file: the load-time rewrite reads
   * the graph only and makes each initializer of 1 KB or more external data naming the file itself at
   * the offset where its bytes lie (the tables a Gather reads, embeddings, still read in), and
   * onnxruntime reads them from there. Loading then holds about half the memory at its peak (the
   * `smollm2-135m` preset, 538 MB: 2.07 → 1.03 GB) and is faster, but one stream of the smollm2
   * preset decoded ~5 % slower at the engine (medians of 6 and 8 side-by-side pairs; the bench model
   * within its noise, −3.3 % to +2.4 % in three designs; raw sessions side by side showed no gap), and
   * the cause is not known (docs/engine.md, "Inline weights read in place"). Off by default for that.
   * Models whose weights are already in external-data files are read the same either way.
   * @defaultValue false
   */
  weightsInPlace?: boolean;
  /**
   * Prompts prefilled together in one model call, at most (plain-form graphs; whole prompts with
   * nothing cached yet, grouped by length, right-padded to the longest of the call). A batch-1
   * prefill call reads all the weights for a few tokens, so a burst of newcomers is prefilled sooner
   * together (docs/engine.md, "Prefilling a burst"). 1 = one prompt per call. A prompt prefilled with
   * others gets the numbers it gets alone, to the bit (docs/engine.md, "Batch invariance").
   * @defaultValue 32
   */
  maxPrefillBatch?: number;
  /**
   * A step runs its prompts' prefill calls, then its decode, in which the prompts it just prefilled
   * take their second token. Each prompt's first token leaves as its own prefill call ends (true);
   * when the step's last prefill call ends, before its decode (`'after-prefills'`: with one prefill
   * call in the step, the same as true); or with the step's output once every call of the step, the
   * decode included, is done (false: its first two tokens then come together). Every later token
   * comes at the same time in all three: true moves a burst's early first tokens forward, and the
   * wait for the step's remaining prefill calls into their stream's first inter-token gap;
   * `'after-prefills'` keeps that wait in the time to first token, so the first gap is one decode
   * call; false keeps the decode call in it too. A step that holds its first tokens back (not true)
   * also prefills the prompts that arrive while its prefill calls run, while the rows it holds
   * outnumber those that were decoding (up to one more step budget of prompt tokens): a burst that
   * reaches the engine over several steps leaves together, as if it had come at once (docs/engine.md,
   * "A step").
   * @defaultValue true
   */
  earlyFirstTokens?: EarlyFirstTokens;
}

export type ContinuationMode = 'replay' | 'prefill';

export type KvGrowth = 'spread' | 'in-place';

/** See {@link EngineOptions.gqaAttention}. */
export type GqaAttention = 'op' | 'decomposed';

/** Sampling and stopping parameters of one request (OpenAI / vLLM semantics). */
export interface SamplingParams {
  /** @defaultValue 16 */
  maxTokens?: number;
  /** 0 means greedy. @defaultValue 1 */
  temperature?: number;
  /** @defaultValue 1 */
  topP?: number;
  /** 0 or -1 disables. @defaultValue 0 */
  topK?: number;
  /** @defaultValue 0 */
  minP?: number;
  /** @defaultValue 0 */
  presencePenalty?: number;
  /** @defaultValue 0 */
  frequencyPenalty?: number;
  /** @defaultValue 1 */
  repetitionPenalty?: number;
  /** Per-request generator seed: the same seed gives the same tokens whatever else is in the batch. */
  seed?: number;
  /** Return the sampled token's logprob. */
  logprobs?: boolean;
  /** Also return this many most likely alternatives per position (0–20). */
  topLogprobs?: number;
  stop?: string[];
  stopTokenIds?: number[];
  ignoreEos?: boolean;
  /**
   * `[tokenId, bias]` pairs added to the model's logits before penalties and sampling (OpenAI's
   * `logit_bias`, vLLM's order): −100 all but bans a token, 100 all but forces it. Logprobs stay the
   * raw model's. @defaultValue []
   */
  logitBias?: ReadonlyArray<readonly [tokenId: number, bias: number]>;
  /** Sibling sequences sharing the prompt's prefill. @defaultValue 1 */
  n?: number;
}

export interface GenerateRequest {
  /** Caller's request id, echoed in errors and logs. */
  id: string;
  /** Prompt token ids (the caller applies the chat template and tokenizes). */
  promptTokenIds: number[];
  sampling: SamplingParams;
  /**
   * Continues one choice of a request that another engine started (its worker died): the tokens it
   * already generated are prefilled after the prompt and count as its output (max tokens, penalties,
   * the stop-string window and the detokenizer see them; they are not emitted again), and its
   * random draws resume at their position. Requires `sampling.n` 1; `choiceIndex` names the
   * choice (its events' index and its random stream).
   */
  continuation?: { choiceIndex: number; generatedTokenIds: number[] };
}

export interface TokenLogprob {
  tokenId: number;
  token: string;
  logprob: number;
  /** The token's raw bytes (may be part of a UTF-8 character, which `token` shows as U+FFFD). */
  bytes?: number[];
  topLogprobs?: Array<{ tokenId: number; token: string; logprob: number; bytes?: number[] }>;
}

export type FinishReason = 'stop' | 'length' | 'abort' | 'error';

export interface Usage {
  promptTokens: number;
  completionTokens: number;
}

export interface RequestTimings {
  /** Submitted → first scheduled. */
  queueMs: number;
  /** First scheduled → prompt fully prefilled. */
  prefillMs: number;
  /** Submitted → first token sampled. */
  firstTokenMs: number;
}

/** Events of one request, in order. All events of one engine step are delivered in the same macrotask. */
export type EngineEvent =
  /**
   * The request left the engine's waiting queue: it has a row and KV space, and its prefill starts
   * in this step (the end of its queue time; a request waits here while the batch or the cache is
   * full). Once per request, before its first token.
   */
  | { type: 'scheduled' }
  | {
      type: 'text-delta';
      /** Choice index (0..n-1). */
      index: number;
      tokenIds: number[];
      text: string;
      logprobs?: TokenLogprob[];
    }
  | { type: 'text-end'; index: number; finishReason: FinishReason }
  | { type: 'finish'; usage: Usage; timings: RequestTimings; error?: { code: EngineErrorCode; message: string } };

/** One event of a submitted request, with the request's id. */
export type StepEvent = readonly [requestId: string, event: EngineEvent];

export type EngineErrorCode = 'context_length_exceeded' | 'invalid_request' | 'provider_unavailable' | 'engine_closed' | 'internal';

/** Numbers about one engine step, for the caller's metrics. */
export interface StepStats {
  phase: 'prefill' | 'decode' | 'mixed';
  batchSize: number;
  /** Tokens fed to the model this step. */
  stepTokens: number;
  /** Whole step wall time (schedule + pack + run + sample + detokenize). */
  stepMs: number;
  /** Time inside session.run(). */
  modelMs: number;
  running: number;
  waiting: number;
  cachedTokens: number;
  maxCachedTokens: number;
  promptTokens: number;
  /** Model calls this step made for prompt chunks (several whole prompts may share one: {@link EngineOptions.maxPrefillBatch}). */
  prefillCalls: number;
  /** Prompt chunks fed this step (whole prompts or pieces of one), in its {@link prefillCalls} calls. */
  promptChunks: number;
  generationTokens: number;
  /**
   * Whole-cache copies made inside this step (the decode lane's capacity changed in place, or its
   * buffers were reallocated): every running row waited for each. With `kvGrowth: 'spread'` growth
   * makes none; joiners longer than the capacity and shrinking still do.
   */
  kvRelayouts: number;
  /**
   * The engine thread's largest event-loop delay since the previous step (ms). A model run blocks
   * that thread, so it tracks the step time; it is how long an abort or a newcomer can wait there.
   */
  eventLoopLagMs?: number;
}

export interface EngineInfo {
  modelId: string;
  /** Prompt + completion tokens a request may have: the model's context, or the whole KV cache (`maxCachedTokens`) if smaller. */
  maxContextLength: number;
  maxBatchSize: number;
  /** Tokens the KV cache holds over all sequences (`maxCachedTokens`): n choices of a request share it. */
  maxCachedTokens: number;
  executionProvider: ExecutionProvider;
  /** Bytes of KV cache reserved and written at start ({@link EngineOptions.kvPreallocate}); 0 without it. */
  kvReservedBytes: number;
  /** onnxruntime intra-op threads of the session (0: onnxruntime chose). */
  intraOpThreads: number;
  /**
   * Where decode rows' keys and values live: `engine-owned` when the graph was rewritten at load to
   * return each step's new slices (the engine keeps the cache and copies nothing per step), `present`
   * when the graph's `present.*` outputs are fetched and fed back (a pattern the rewrite does not know:
   * every step copies the whole cache; docs/engine.md, "KV cache").
   */
  kvCache: 'engine-owned' | 'present';
  /**
   * What the model's GroupQueryAttention runs as: `none` (the model has none), `op` (onnxruntime's
   * operator), `decomposed` (replaced by the plain form's ops: {@link EngineOptions.gqaAttention}).
   */
  groupQueryAttention: 'none' | 'op' | 'decomposed';
  /**
   * Layers whose attention over `present.*` (Optimum's exports) the load-time rewrite made read the
   * past and the new slots separately, so that no step copies the cache (docs/engine.md, "Attention
   * over `present.*`"); 0 for graphs in another form.
   */
  splitAttentionLayers: number;
}

export interface Engine {
  readonly info: EngineInfo;
  /**
   * Streams one request's events. Throws EngineError at once for a request that can never fit
   * (prompt + max_tokens beyond the context length) or has invalid parameters. Aborting the signal
   * removes the request at the next step boundary; the stream then ends with finish reason 'abort'.
   */
  generate(request: GenerateRequest, signal?: AbortSignal): AsyncIterable<EngineEvent>;
  /**
   * Starts a request like {@link generate}, but its events go to the {@link onEvents} listeners only, a
   * whole step at a time (a caller that routes each step as a whole: the worker). Throws like generate.
   */
  submit(request: GenerateRequest, signal?: AbortSignal): void;
  /**
   * Called once per engine step with the events of every submitted request in that step, in order,
   * each with its request's id. Returns an unsubscribe function.
   */
  onEvents(listener: (events: ReadonlyArray<StepEvent>) => void): () => void;
  /** Called after every step with its numbers. Returns an unsubscribe function. */
  onStep(listener: (stats: StepStats) => void): () => void;
  /**
   * Called once if the engine thread dies (an uncaught error, an exit) while the engine is not being
   * closed, with why; before the open requests end with an `internal` error. Returns an unsubscribe function.
   */
  onDeath(listener: (reason: string) => void): () => void;
  close(): Promise<void>;
}
