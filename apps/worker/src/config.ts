import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { z } from 'zod';
import type { EarlyFirstTokens, EngineOptions, IntraOpSpinning } from '@sluice/engine';
import { DEFAULT_PREFIX, envFlag, envInput, envInt as int, envMs as ms } from '@sluice/protocol';

/** Every setting of the worker, read from the environment once at start (errors name the variable). */
export const workerEnvSchema = z.object({
  /** Redis for the queue, pub/sub and the registry. @defaultValue redis://127.0.0.1:6379 */
  REDIS_URL: z.url({ protocol: /^rediss?$/ }).default('redis://127.0.0.1:6379'),
  /** Prefix of every Sluice key and channel in Redis. @defaultValue sluice */
  REDIS_PREFIX: z.string().min(1).default(DEFAULT_PREFIX),
  /** Model directory (Hugging Face / Optimum ONNX layout). @defaultValue the built-in tiny model */
  MODEL_DIR: z.string().min(1).optional(),
  /** Model id served under `/v1/models`. @defaultValue the model directory's id */
  MODEL_ID: z.string().min(1).optional(),
  /** Max sequences decoded together. @defaultValue 32 */
  MAX_BATCH_SIZE: int(1).default(32),
  /** Max tokens fed to the model in one step (prefill chunk + decodes); at least MAX_BATCH_SIZE. @defaultValue 512 */
  MAX_STEP_TOKENS: int(1).default(512),
  /** Whole prompts prefilled together in one model call, at most (1 = one prompt per call). @defaultValue 32 */
  MAX_PREFILL_BATCH: int(1).default(32),
  /**
   * Cap on tokens in the KV cache over all sequences; below the model's context length it is also the
   * context a request may have here (what the worker advertises). @defaultValue MAX_BATCH_SIZE × context length
   */
  MAX_CACHED_TOKENS: int(1).optional(),
  /** onnxruntime execution provider. @defaultValue cpu */
  EXECUTION_PROVIDER: z.enum(['cpu', 'cuda', 'webgpu']).default('cpu'),
  /** onnxruntime intra-op threads (0 = one per physical core, from the kernel's CPU topology). @defaultValue 0 */
  INTRA_OP_THREADS: int(0).default(0),
  /** onnxruntime inter-op threads (0 = its default). @defaultValue 0 */
  INTER_OP_THREADS: int(0).default(0),
  /**
   * Whether onnxruntime's intra-op threads spin while waiting for work: `during-run` they spin while
   * a model call runs (no wake-up per parallel section) and stop when it ends, leaving the cores to
   * the worker's host thread, Redis and the gateway; `false` they block between sections too; `true`
   * they also spin after a call (measured through the whole stack: docs/engine.md "Spinning").
   * @defaultValue during-run
   */
  INTRA_OP_SPINNING: envFlag('during-run').default('during-run'),
  /**
   * How a continuation (a migrated stream) feeds the tokens already generated: `replay` one decode
   * step each (the next logits are the original run's bit for bit; one step per token), `prefill`
   * in one pass (faster; logits may differ in the last bits). @defaultValue replay
   */
  CONTINUATION_MODE: z.enum(['replay', 'prefill']).default('replay'),
  /**
   * How the KV cache grows: `in-place` moves it in the step that needs room (one latency spike per
   * growth); `spread` prepares the larger layout over the steps before (no such spike; up to twice the
   * KV memory; measured, no throughput cost on the bench model, 4–12 % on the SmolLM2-shaped one).
   * @defaultValue in-place
   */
  KV_GROWTH: z.enum(['spread', 'in-place']).default('in-place'),
  /**
   * GroupQueryAttention models (onnxruntime-genai's exports): `decomposed` runs the plain form's
   * attention ops instead of onnxruntime's operator, which copies every row's cache each layer and
   * step (2.3× the tokens/s at 32 streams × 768 tokens measured; the operator stays where the ops
   * would compute something else); `op` runs the operator. Both keep a request's numbers independent
   * of its batch to the last bit; `op` also of the step budget that cut its prompt. Other models are
   * unaffected. @defaultValue decomposed
   */
  GQA_ATTENTION: z.enum(['op', 'decomposed']).default('decomposed'),
  /**
   * Reserve the KV cache at start: MAX_CACHED_TOKENS slots written before the worker takes jobs, so
   * the first burst does not fault its cache in during its steps. Holds that memory from the start
   * (set MAX_CACHED_TOKENS to what the machine can hold). @defaultValue false
   */
  KV_PREALLOCATE: envFlag().default(false),
  /**
   * Leave the weights of a model stored inside model.onnx in that file (onnxruntime reads them from
   * there): about half the memory at load's peak and a faster load, for a one-stream decode measured
   * a few percent slower (EngineOptions.weightsInPlace). @defaultValue false
   */
  WEIGHTS_IN_PLACE: envFlag().default(false),
  /**
   * A prompt's first token leaves as its own prefill call ends (true); when its step's last prefill
   * call ends, before the decode (`after-prefills`); or with the rest of its step's output, its second
   * token included (false). Later: a burst's early first tokens; shorter: its streams' first gaps.
   * The two later modes also take in the prompts that arrive while the step prefills (a burst).
   * @defaultValue true
   */
  EARLY_FIRST_TOKENS: envFlag('after-prefills').default(true),
  /** Jobs taken from the queue at once. @defaultValue MAX_BATCH_SIZE */
  WORKER_CONCURRENCY: int(1).optional(),
  /** This worker's id in the registry: one live worker per id (a second is refused at start). @defaultValue host-pid-random */
  WORKER_ID: z
    .string()
    .regex(/^[\w.-]+$/)
    .optional(),
  /** How often the registry record is refreshed. @defaultValue 1000 */
  WORKER_HEARTBEAT_MS: ms(50).default(1000),
  /** Registry record TTL: gateways fail this worker's streams this long after its last heartbeat. @defaultValue 5000 */
  WORKER_TTL_MS: ms(100).default(5000),
  /** How long a request's token log stays readable after it ends (resume, gap repair). @defaultValue 600000 */
  STREAM_RETENTION_MS: ms(1000).default(600_000),
  /** Approximate cap on the entries of one request's token log (Redis XADD MAXLEN ~). @defaultValue 100000 */
  STREAM_MAX_ENTRIES: int(100).default(100_000),
  /** On SIGTERM: how long running sequences may take to finish before they are ended. @defaultValue 30000 */
  DRAIN_TIMEOUT_MS: ms(0).default(30_000),
  /**
   * On SIGTERM, once the drain is done: how long to wait at most for one more scrape of `/metrics` (METRICS_PORT)
   * (only when Prometheus scrapes at a steady pace: at most 2 × its interval + 5 s), so that the
   * counts of the last requests are read before the process and its series go. 0: no wait. @defaultValue 0
   */
  FINAL_SCRAPE_MAX_MS: ms(0).default(0),
  /** BullMQ job lock duration; a job whose worker died is retried this long after (stalled check). @defaultValue 30000 */
  LOCK_DURATION_MS: ms(1000).default(30_000),
  /** Port of the worker's HTTP endpoint (`/healthz`); 0 picks a free port. @defaultValue 9464 */
  METRICS_PORT: int(0, 65535).default(9464),
  /** Listen address of that endpoint: loopback unless set (e.g. 0.0.0.0 for a Prometheus on another host). @defaultValue 127.0.0.1 */
  METRICS_HOST: z.string().min(1).default('127.0.0.1'),
  /** `/healthz` shows the id of the latest cancelled request (tests only: ids never leave the worker otherwise). @defaultValue false */
  HEALTH_REQUEST_IDS: envFlag().default(false),
  /** pino log level. @defaultValue info */
  LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
});

export interface WorkerConfig {
  redisUrl: string;
  redisPrefix: string;
  modelDir: string | undefined;
  modelId: string | undefined;
  maxBatchSize: number;
  maxStepTokens: number;
  maxPrefillBatch: number;
  maxCachedTokens: number | undefined;
  executionProvider: 'cpu' | 'cuda' | 'webgpu';
  intraOpThreads: number;
  intraOpSpinning: IntraOpSpinning;
  continuationMode: 'replay' | 'prefill';
  kvGrowth: 'spread' | 'in-place';
  gqaAttention: 'op' | 'decomposed';
  kvPreallocate: boolean;
  weightsInPlace: boolean;
  earlyFirstTokens: EarlyFirstTokens;
  interOpThreads: number;
  concurrency: number;
  workerId: string;
  heartbeatMs: number;
  ttlMs: number;
  drainTimeoutMs: number;
  finalScrapeMaxMs: number;
  streamRetentionMs: number;
  maxLogEntries: number;
  lockDurationMs: number;
  metricsPort: number;
  metricsHost: string;
  logLevel: z.infer<typeof workerEnvSchema>['LOG_LEVEL'];
  healthRequestIds: boolean;
}

export class ConfigError extends Error {
  override name = 'ConfigError';
}

/** Reads and validates the environment. Empty and blank (whitespace-only) values count as unset. */
export function loadWorkerConfig(env: NodeJS.ProcessEnv = process.env): WorkerConfig {
  const input = envInput(env);
  const parsed = workerEnvSchema.safeParse(input);
  if (!parsed.success) {
    const lines = parsed.error.issues.map((issue) => `  ${issue.path.join('.')}: ${issue.message}`);
    throw new ConfigError(`invalid worker configuration:\n${lines.join('\n')}`);
  }
  const e = parsed.data;
  // Values valid alone that cannot go together: refused here, before the model loads, naming them.
  const conflicts: string[] = [];
  if (e.WORKER_TTL_MS <= e.WORKER_HEARTBEAT_MS) conflicts.push('WORKER_TTL_MS: must be greater than WORKER_HEARTBEAT_MS');
  if (e.MAX_STEP_TOKENS < e.MAX_BATCH_SIZE) {
    // The engine refuses it too (EngineOptions.maxStepTokens), but only once the model is loaded.
    const value = input.MAX_STEP_TOKENS === undefined ? `${e.MAX_STEP_TOKENS} (its default)` : String(e.MAX_STEP_TOKENS);
    conflicts.push(
      `MAX_STEP_TOKENS: must be at least MAX_BATCH_SIZE (${e.MAX_BATCH_SIZE}), got ${value}: a full batch's decodes alone feed that many tokens a step`,
    );
  }
  if (conflicts.length > 0) throw new ConfigError(`invalid worker configuration:\n${conflicts.map((line) => `  ${line}`).join('\n')}`);
  return {
    redisUrl: e.REDIS_URL,
    redisPrefix: e.REDIS_PREFIX,
    modelDir: e.MODEL_DIR,
    modelId: e.MODEL_ID,
    maxBatchSize: e.MAX_BATCH_SIZE,
    maxStepTokens: e.MAX_STEP_TOKENS,
    maxPrefillBatch: e.MAX_PREFILL_BATCH,
    maxCachedTokens: e.MAX_CACHED_TOKENS,
    executionProvider: e.EXECUTION_PROVIDER,
    intraOpThreads: e.INTRA_OP_THREADS,
    interOpThreads: e.INTER_OP_THREADS,
    intraOpSpinning: e.INTRA_OP_SPINNING,
    continuationMode: e.CONTINUATION_MODE,
    kvGrowth: e.KV_GROWTH,
    gqaAttention: e.GQA_ATTENTION,
    kvPreallocate: e.KV_PREALLOCATE,
    weightsInPlace: e.WEIGHTS_IN_PLACE,
    earlyFirstTokens: e.EARLY_FIRST_TOKENS,
    concurrency: e.WORKER_CONCURRENCY ?? e.MAX_BATCH_SIZE,
    workerId: e.WORKER_ID ?? `${hostname().replace(/[^\w.-]/g, '-')}-${process.pid}-${randomBytes(3).toString('hex')}`,
    heartbeatMs: e.WORKER_HEARTBEAT_MS,
    ttlMs: e.WORKER_TTL_MS,
    drainTimeoutMs: e.DRAIN_TIMEOUT_MS,
    finalScrapeMaxMs: e.FINAL_SCRAPE_MAX_MS,
    streamRetentionMs: e.STREAM_RETENTION_MS,
    maxLogEntries: e.STREAM_MAX_ENTRIES,
    lockDurationMs: e.LOCK_DURATION_MS,
    metricsPort: e.METRICS_PORT,
    metricsHost: e.METRICS_HOST,
    logLevel: e.LOG_LEVEL,
    healthRequestIds: e.HEALTH_REQUEST_IDS,
  };
}

/**
 * The engine's options as this worker runs it, for `modelDir`: one mapping shared by the worker and
 * by benchmarks that run "the engine alone" (they must match the worker's settings to be comparable).
 */
export function engineOptions(config: WorkerConfig, modelDir: string): EngineOptions {
  return {
    modelDir,
    maxBatchSize: config.maxBatchSize,
    maxStepTokens: config.maxStepTokens,
    ...(config.maxCachedTokens === undefined ? {} : { maxCachedTokens: config.maxCachedTokens }),
    executionProvider: config.executionProvider,
    intraOpThreads: config.intraOpThreads,
    interOpThreads: config.interOpThreads,
    intraOpSpinning: config.intraOpSpinning,
    continuationMode: config.continuationMode,
    kvGrowth: config.kvGrowth,
    gqaAttention: config.gqaAttention,
    kvPreallocate: config.kvPreallocate,
    weightsInPlace: config.weightsInPlace,
    maxPrefillBatch: config.maxPrefillBatch,
    earlyFirstTokens: config.earlyFirstTokens,
  };
}

/**
 * The engine's settings as the variables that set them, with the model's context length: what the
 * worker names when its engine does not start. Some limits are only known with the model (the KV cache
 * that KV_PREALLOCATE reserves is MAX_BATCH_SIZE × 1.25 × the context length), so config cannot check them.
 */
export function describeEngineSettings(config: WorkerConfig, contextLength: number): string {
  const cached =
    config.maxCachedTokens === undefined
      ? `unset (MAX_BATCH_SIZE × context length = ${config.maxBatchSize * contextLength})`
      : String(config.maxCachedTokens);
  const settings = [
    `MAX_BATCH_SIZE=${config.maxBatchSize}`,
    `MAX_STEP_TOKENS=${config.maxStepTokens}`,
    `MAX_CACHED_TOKENS=${cached}`,
    `MAX_PREFILL_BATCH=${config.maxPrefillBatch}`,
    `KV_PREALLOCATE=${config.kvPreallocate}`,
    `WEIGHTS_IN_PLACE=${config.weightsInPlace}`,
    `KV_GROWTH=${config.kvGrowth}`,
    `EXECUTION_PROVIDER=${config.executionProvider}`,
  ];
  return `${settings.join(', ')}; the model's context length: ${contextLength}`;
}
