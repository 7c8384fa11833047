import { ScrapeWatch, scrapeRegistry } from './scrape-watch.js';
import { Counter, Gauge, Histogram, Registry } from 'prom-client';
import {
  BATCH_SIZE_BUCKETS,
  QUEUE_TIME_BUCKETS,
  REQUEST_TOKENS_BUCKETS,
  STEP_TIME_BUCKETS,
  STEP_TOKENS_BUCKETS,
  TIME_TO_FIRST_TOKEN_BUCKETS,
} from './buckets.js';
import { ensureDefaultMetrics } from './default-metrics.js';
import type { EventLoopDelay } from './event-loop-delay.js';

export type StepPhase = 'prefill' | 'decode' | 'mixed';

/**
 * Numbers about one engine step. Structurally the engine's `StepStats` (this package does not import
 * the engine: the worker passes what `engine.onStep` gives it).
 */
export interface EngineStepStats {
  phase: StepPhase;
  /** Sequences in the step's batch. */
  batchSize: number;
  /** Tokens fed to the model this step. */
  stepTokens: number;
  /** Whole step wall time, ms. */
  stepMs: number;
  /** Time inside the model run, ms. */
  modelMs: number;
  /** Requests being decoded after the step. */
  running: number;
  /** Requests admitted to the engine but not yet scheduled. */
  waiting: number;
  cachedTokens: number;
  maxCachedTokens: number;
  /** Prompt tokens prefilled this step. */
  promptTokens: number;
  /** Tokens sampled this step. */
  generationTokens: number;
  /** Whole KV-cache copies made inside this step (every running sequence waited for each). */
  kvRelayouts?: number;
}

export type FinishReason = 'stop' | 'length' | 'abort' | 'error';

/** What the worker knows when a request leaves the engine: the engine's `finish` event, plus a reason. */
export interface FinishedRequestStats {
  finishReason: FinishReason;
  usage: { promptTokens: number; completionTokens: number };
  /** Engine timings, ms. Absent when the request never reached the engine. */
  timings?: { queueMs: number; prefillMs: number };
}

/** BullMQ job states the worker reports. `queue.getJobCounts(...QUEUE_JOB_STATES)` has this shape. */
export type QueueJobState = 'waiting' | 'active' | 'delayed' | 'failed';
export type QueueDepth = Partial<Record<QueueJobState, number>>;

export const QUEUE_JOB_STATES: readonly QueueJobState[] = ['waiting', 'active', 'delayed', 'failed'];
const STEP_PHASES: readonly StepPhase[] = ['prefill', 'decode', 'mixed'];
const FINISH_REASONS: readonly FinishReason[] = ['stop', 'length', 'abort', 'error'];

/** Metrics of one worker process. Create one per process and serve `registry` on `METRICS_PORT`. */
export interface WorkerMetrics {
  readonly registry: Registry;
  /** The registry read for `GET /metrics`; the scrape is noted (see {@link ScrapeWatch}). */
  scrape(): Promise<string>;
  /** Resolves at the next scrape of a process scraped at a steady pace, within `maxMs` (ScrapeWatch.nextScrape). */
  nextScrape(maxMs: number): Promise<void>;
  /**
   * The host thread's event-loop delay (`nodejs_eventloop_lag_*` and
   * `sluice_worker_host_event_loop_lag_seconds`): `begin()` for each job taken, its end when the job
   * settles; measured only while one runs.
   */
  readonly eventLoopDelay: EventLoopDelay;
  readonly requestsRunning: Gauge;
  readonly requestsWaiting: Gauge;
  readonly kvCacheUsage: Gauge;
  readonly promptTokens: Counter;
  readonly generationTokens: Counter;
  readonly batchSize: Histogram;
  readonly stepTokens: Histogram;
  readonly stepTime: Histogram<'phase'>;
  readonly modelRunTime: Histogram<'phase'>;
  readonly requestSuccess: Counter<'finish_reason'>;
  readonly requestPromptTokens: Histogram;
  readonly requestGenerationTokens: Histogram<'finish_reason'>;
  readonly engineQueueTime: Histogram;
  readonly requestPrefillTime: Histogram;
  readonly queueJobs: Gauge<'state'>;
  readonly engineEventLoopLag: Gauge;
  readonly hostEventLoopLag: Gauge<'quantile'>;
  /** Records one engine step: batch, step and model time, token counters, running/waiting, KV usage. */
  observeStep(stats: EngineStepStats): void;
  /** Records one request leaving the engine: its outcome, its lengths and its engine timings. */
  observeRequestFinished(stats: FinishedRequestStats): void;
  /** Sets the queue depth gauges (states left out keep their value). */
  setQueueDepth(depth: QueueDepth): void;
  /**
   * Reads the queue depth at every scrape (e.g. `() => queue.getJobCounts(...QUEUE_JOB_STATES)`).
   * A source that fails or takes longer than `timeoutMs` leaves the last values: a scrape must not
   * fail or hang because Redis does. Pass `undefined` to stop.
   */
  setQueueDepthSource(source: (() => Promise<QueueDepth>) | undefined, timeoutMs?: number): void;
  /** Sets the engine thread's latest event-loop lag, ms, as the engine thread measured it (sent with a step's stats). */
  setEngineEventLoopLag(lagMs: number): void;
}

/**
 * Creates the worker's metrics in `registry` (a fresh one by default), with Node's default process
 * metrics (added once per registry). Nothing is registered until this is called.
 */
export function createWorkerMetrics(registry: Registry = new Registry()): WorkerMetrics {
  const defaults = ensureDefaultMetrics(registry);
  const registers = [registry];
  let queueDepthSource: { read: () => Promise<QueueDepth>; timeoutMs: number } | undefined;

  const requestsRunning = new Gauge({
    name: 'sluice_num_requests_running',
    help: 'Requests in the engine batch (being prefilled or decoded), after the latest step.',
    registers,
  });
  const requestsWaiting = new Gauge({
    name: 'sluice_num_requests_waiting',
    help: 'Requests taken by this worker and waiting in the engine for a batch slot or KV space, after the latest step.',
    registers,
  });
  const kvCacheUsage = new Gauge({
    name: 'sluice_kv_cache_usage_perc',
    help: 'Fraction of the KV cache token budget in use, from 0 to 1 (1 means 100 percent), after the latest step.',
    registers,
  });
  const promptTokens = new Counter({
    name: 'sluice_prompt_tokens_total',
    help: 'Prompt tokens prefilled by the engine.',
    registers,
  });
  const kvRelayouts = new Counter({
    name: 'sluice_kv_cache_relayouts_total',
    help: 'Whole KV-cache copies made inside an engine step (capacity grown or shrunk in place, or buffers reallocated); every running sequence waited for each.',
    registers,
  });
  const generationTokens = new Counter({
    name: 'sluice_generation_tokens_total',
    help: 'Tokens generated by the engine, all choices, including those of requests later aborted.',
    registers,
  });
  const batchSize = new Histogram({
    name: 'sluice_worker_batch_size',
    help: 'Sequences in the batch of one engine step.',
    buckets: [...BATCH_SIZE_BUCKETS],
    registers,
  });
  const stepTokens = new Histogram({
    name: 'sluice_worker_step_tokens',
    help: 'Tokens fed to the model in one engine step (prefill chunk tokens plus one per decoding sequence).',
    buckets: [...STEP_TOKENS_BUCKETS],
    registers,
  });
  const stepTime = new Histogram({
    name: 'sluice_worker_step_seconds',
    help: 'Wall time of one engine step (schedule, pack, model run, sample, detokenize), by phase.',
    labelNames: ['phase'] as const,
    buckets: [...STEP_TIME_BUCKETS],
    registers,
  });
  const modelRunTime = new Histogram({
    name: 'sluice_worker_model_run_seconds',
    help: 'Time inside the model run (session.run) of one engine step, by phase.',
    labelNames: ['phase'] as const,
    buckets: [...STEP_TIME_BUCKETS],
    registers,
  });
  const requestSuccess = new Counter({
    name: 'sluice_request_success_total',
    help: 'Requests that left the engine, by finish reason: stop, length, abort or error.',
    labelNames: ['finish_reason'] as const,
    registers,
  });
  const requestPromptTokens = new Histogram({
    name: 'sluice_request_prompt_tokens',
    help: 'Prompt length of finished requests, in tokens.',
    buckets: [...REQUEST_TOKENS_BUCKETS],
    registers,
  });
  const requestGenerationTokens = new Histogram({
    name: 'sluice_request_generation_tokens',
    help: 'Tokens generated for finished requests (all choices), by finish reason.',
    labelNames: ['finish_reason'] as const,
    buckets: [...REQUEST_TOKENS_BUCKETS],
    registers,
  });
  const engineQueueTime = new Histogram({
    name: 'sluice_worker_engine_queue_time_seconds',
    help: 'Time a request waited inside the engine, submitted to first scheduled (the engine part of the queue time).',
    buckets: [...QUEUE_TIME_BUCKETS],
    registers,
  });
  const requestPrefillTime = new Histogram({
    name: 'sluice_request_prefill_time_seconds',
    help: 'Time from first scheduled to prompt fully prefilled, for requests that produced a token.',
    buckets: [...TIME_TO_FIRST_TOKEN_BUCKETS],
    registers,
  });
  const queueJobs = new Gauge({
    name: 'sluice_worker_queue_jobs',
    help: 'Jobs in the BullMQ queue by state (waiting, active, delayed, failed), as this worker last read them.',
    labelNames: ['state'] as const,
    registers,
    async collect() {
      if (queueDepthSource === undefined) return;
      const depth = await withTimeout(queueDepthSource.read(), queueDepthSource.timeoutMs);
      if (depth !== undefined) setQueueDepth(depth);
    },
  });
  const engineEventLoopLag = new Gauge({
    name: 'sluice_worker_engine_event_loop_lag_seconds',
    help: 'Latest event-loop lag of the engine thread. A model run blocks that thread, so values near the step time are expected.',
    registers,
  });

  const hostEventLoopLag = new Gauge({
    name: 'sluice_worker_host_event_loop_lag_seconds',
    help: 'Event-loop delay of the worker host thread (Redis I/O, BullMQ locks, cancels, publishing; not the engine thread) since the previous scrape, measured while jobs run (0 for a window without one), by quantile (0.5, 0.99, 1 = max).',
    labelNames: ['quantile'] as const,
    registers,
  });

  // Series that exist from the first scrape, so rate() and increase() see their first increment.
  for (const phase of STEP_PHASES) {
    stepTime.zero({ phase });
    modelRunTime.zero({ phase });
  }
  for (const reason of FINISH_REASONS) {
    requestSuccess.labels(reason).inc(0);
    requestGenerationTokens.zero({ finish_reason: reason });
  }
  for (const state of QUEUE_JOB_STATES) queueJobs.labels(state).set(0);

  function setQueueDepth(depth: QueueDepth): void {
    for (const state of QUEUE_JOB_STATES) {
      const count = depth[state];
      if (count !== undefined) queueJobs.labels(state).set(count);
    }
  }

  const scrapes = new ScrapeWatch();
  return {
    registry,
    scrape: () => {
      // The host thread is the process's main thread: one window feeds both its gauges and Node's.
      const window = defaults.takeEventLoopDelay();
      hostEventLoopLag.labels('0.5').set(window.p50);
      hostEventLoopLag.labels('0.99').set(window.p99);
      hostEventLoopLag.labels('1').set(window.max);
      return scrapeRegistry(registry, scrapes);
    },
    nextScrape: (maxMs) => scrapes.nextScrape(maxMs),
    eventLoopDelay: defaults.eventLoopDelay,
    requestsRunning,
    requestsWaiting,
    kvCacheUsage,
    promptTokens,
    generationTokens,
    batchSize,
    stepTokens,
    stepTime,
    modelRunTime,
    requestSuccess,
    requestPromptTokens,
    requestGenerationTokens,
    engineQueueTime,
    requestPrefillTime,
    queueJobs,
    engineEventLoopLag,
    hostEventLoopLag,
    observeStep(stats) {
      batchSize.observe(stats.batchSize);
      stepTokens.observe(stats.stepTokens);
      stepTime.observe({ phase: stats.phase }, stats.stepMs / 1000);
      modelRunTime.observe({ phase: stats.phase }, stats.modelMs / 1000);
      if (stats.promptTokens > 0) promptTokens.inc(stats.promptTokens);
      if (stats.generationTokens > 0) generationTokens.inc(stats.generationTokens);
      if ((stats.kvRelayouts ?? 0) > 0) kvRelayouts.inc(stats.kvRelayouts);
      requestsRunning.set(stats.running);
      requestsWaiting.set(stats.waiting);
      kvCacheUsage.set(stats.maxCachedTokens > 0 ? stats.cachedTokens / stats.maxCachedTokens : 0);
    },
    observeRequestFinished({ finishReason, usage, timings }) {
      requestSuccess.labels(finishReason).inc();
      requestPromptTokens.observe(usage.promptTokens);
      requestGenerationTokens.observe({ finish_reason: finishReason }, usage.completionTokens);
      if (timings === undefined) return;
      engineQueueTime.observe(timings.queueMs / 1000);
      if (usage.completionTokens > 0) requestPrefillTime.observe(timings.prefillMs / 1000);
    },
    setQueueDepth,
    setQueueDepthSource(read, timeoutMs = 1000) {
      queueDepthSource = read === undefined ? undefined : { read, timeoutMs };
    },
    setEngineEventLoopLag(lagMs) {
      engineEventLoopLag.set(lagMs / 1000);
    },
  };
}

/** The promise's value, or undefined if it rejects or takes longer than `ms`. */
async function withTimeout<T>(promise: Promise<T>, ms: number): Promise<T | undefined> {
  let timer: NodeJS.Timeout | undefined;
  const expired = new Promise<undefined>((resolve) => {
    timer = setTimeout(resolve, ms, undefined);
  });
  try {
    return await Promise.race([promise.catch(() => undefined), expired]);
  } finally {
    clearTimeout(timer);
  }
}
