import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import type { Engine, EngineErrorCode, EngineEvent, SamplingParams } from '@sluice/engine';
import { decodeRequestMeta, generateJobSchema, type GenerateJob, type RedisNames, type WireError } from '@sluice/protocol';
import type { ControlListener } from './control-listener.js';
import { REDIS_UNAVAILABLE, type Route, type RouteTiming, type StepRouter } from './step-router.js';

/** The reason a drain passes to `abort()`: the client gets `worker_shutdown` instead of silence. */
export const SHUTDOWN_REASON = 'worker_shutdown';

/** Engine field names → OpenAI request fields, for the `param` of an error. */
const FIELD_NAMES: Record<string, string> = {
  promptTokenIds: 'prompt',
  maxTokens: 'max_tokens',
  temperature: 'temperature',
  topP: 'top_p',
  topK: 'top_k',
  minP: 'min_p',
  presencePenalty: 'presence_penalty',
  frequencyPenalty: 'frequency_penalty',
  repetitionPenalty: 'repetition_penalty',
  seed: 'seed',
  topLogprobs: 'top_logprobs',
  stop: 'stop',
  n: 'n',
};

interface EngineErrorLike {
  name: string;
  code: EngineErrorCode;
  message: string;
}

function isEngineError(error: unknown): error is EngineErrorLike {
  return error instanceof Error && error.name === 'EngineError' && 'code' in error;
}

function toWireError(code: EngineErrorCode, message: string): WireError {
  if (code === 'context_length_exceeded') return { code, message: message.replace(/^Request [^:]+: /, ''), param: 'max_tokens' };
  if (code === 'invalid_request') {
    const field = /^Request [^:]+: (\w+) /.exec(message)?.[1];
    return { code, message: message.replace(/^Request [^:]+: /, ''), param: field === undefined ? null : (FIELD_NAMES[field] ?? field) };
  }
  return { code: 'internal', message: 'The engine failed.', param: null };
}

export interface ProcessorCounters {
  /** Sequences (requests) in the engine now. */
  running: number;
  /** Jobs that ran to an end (any end). */
  processed: number;
  /** Jobs not run: cancelled or past their deadline before they started, or recovered after a worker died. */
  skipped: number;
  /** The latest cancelled sequence: ms from the cancel reaching this worker to its leaving the batch. */
  lastCancel: { requestId: string; ms: number } | undefined;
}

/** Observability seams (metrics): called synchronously, must be cheap and never throw. */
export interface WorkerHooks {
  /** A request left the engine (any reason), with the engine's numbers. */
  requestFinished?(stats: {
    finishReason: 'stop' | 'length' | 'abort' | 'error';
    usage: { promptTokens: number; completionTokens: number };
    timings: { queueMs: number; prefillMs: number; firstTokenMs: number };
  }): void;
}

/** Epoch ms (performance.timeOrigin + now) of a job's steps before its first token; the router adds the last two. */
interface ProcessTiming extends RouteTiming {
  pickedUpAt: number;
  checkedAt?: number;
  submittedAt?: number;
}

function epochMs(): number {
  return performance.timeOrigin + performance.now();
}

/**
 * The worker's side of the TTFT breakdown for the log: the pickup on the epoch clock the gateway's
 * line uses, then ms after it, and the engine's own timings (submit → scheduled, prefill, first token).
 */
function timingFields(t: ProcessTiming, engine: { queueMs: number; prefillMs: number; firstTokenMs: number }): Record<string, number> {
  const after = (at: number | undefined) => (at === undefined ? undefined : Math.round((at - t.pickedUpAt) * 1000) / 1000);
  const fields: Record<string, number | undefined> = {
    pickedUpAt: Math.round(t.pickedUpAt * 1000) / 1000,
    checkedMs: after(t.checkedAt),
    submittedMs: after(t.submittedAt),
    firstStepMs: after(t.firstStepAt),
    publishedMs: after(t.publishedAt),
    engineQueueMs: Math.round(engine.queueMs * 1000) / 1000,
    engineFirstTokenMs: Math.round(engine.firstTokenMs * 1000) / 1000,
  };
  return Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined)) as Record<string, number>;
}

export interface ProcessorDeps {
  engine: Pick<Engine, 'submit' | 'info'>;
  router: StepRouter;
  controls: ControlListener;
  /** Command connection (cancel marker, request meta). */
  redis: Redis;
  names: RedisNames;
  workerId: string;
  logger: Logger;
  hooks?: WorkerHooks;
}

/**
 * Job → prompt tokens → validate → accepted/rejected → engine.submit; the step router turns the
 * request's engine events into entries, and the job settles when its sequence finishes. A job retried
 * after its first worker died mid-answer is not run again: its client already got part of an answer,
 * so the stream fails instead of restarting.
 */
export class JobProcessor {
  readonly counters: ProcessorCounters = { running: 0, processed: 0, skipped: 0, lastCancel: undefined };

  constructor(private readonly deps: ProcessorDeps) {}

  /**
   * @param attempt BullMQ's `attemptsStarted`: 1 for the first run; more when the job was recovered
   *   after its worker died (stalled), and its client may already hold part of an answer.
   */
  async process(data: unknown, attempt: number, bullSignal?: AbortSignal): Promise<void> {
    const parsed = generateJobSchema.safeParse(data);
    if (!parsed.success) {
      this.deps.logger.error({ issues: parsed.error.issues.slice(0, 3) }, 'malformed job dropped');
      return;
    }
    const job = parsed.data;
    const timing: ProcessTiming = { pickedUpAt: epochMs() };
    // `requestId` is the id the client sees (x-request-id); `jobId` is the gateway's unique one.
    const log = this.deps.logger.child({ requestId: job.correlationId ?? job.requestId, jobId: job.requestId });
    const controller = new AbortController();
    const onBullAbort = () => controller.abort(SHUTDOWN_REASON);
    bullSignal?.addEventListener('abort', onBullAbort, { once: true });
    this.deps.controls.register(job.requestId, controller);
    let finished!: () => void;
    const done = new Promise<void>((resolve) => (finished = resolve));
    const route = this.deps.router.open({
      requestId: job.requestId,
      channel: job.channel,
      attempt: 1,
      deadlineAt: job.deadlineAt,
      graceMs: job.resumeGraceMs,
      nextSeq: 0,
      timing,
      abort: (reason) => controller.abort(reason),
      onFinish: (event) => {
        this.finish(route, event, controller.signal, log, timing);
        finished();
      },
    });
    try {
      if (await this.start(job, attempt, route, controller.signal, log, timing)) await done;
    } catch (error) {
      log.error({ err: error }, 'job failed');
      this.deps.router.push(route, { type: 'error', error: { code: 'internal', message: 'The worker failed.', param: null } });
    } finally {
      bullSignal?.removeEventListener('abort', onBullAbort);
      this.deps.controls.unregister(job.requestId);
      this.deps.router.close(route);
      this.counters.processed++;
    }
  }

  /** Validates and submits the request; false when it never reached the engine. */
  private async start(job: GenerateJob, attempt: number, route: Route, signal: AbortSignal, logger: Logger, timing: ProcessTiming): Promise<boolean> {
    const { redis, names, engine, router } = this.deps;
    if (signal.aborted || Date.now() >= job.deadlineAt) return this.skip(logger);
    if (attempt > 1) {
      this.counters.skipped++;
      // A retry (stalled-job recovery): the first attempt may have streamed tokens already.
      logger.warn('job retried after a worker was lost: failing its stream');
      router.push(route, { type: 'error', error: { code: 'worker_lost', message: 'The worker serving the request stopped.', param: null } });
      return false;
    }

    logger.debug({ pickupMs: Date.now() - job.enqueuedAt }, 'job started');
    // The cancel marker (a client that left while the job waited) and the request's route (a client
    // that left with a grace, or resumed elsewhere) are read while the prompt is prepared, and checked
    // before the engine sees the request.
    const state = redis.multi().exists(names.cancelMarkerKey(job.requestId)).hgetall(names.metaKey(job.requestId)).exec();
    state.catch(() => undefined);
    const promptTokenIds = this.encode(job);
    if (!Array.isArray(promptTokenIds)) return this.reject(route, promptTokenIds, logger);
    const maxContext = engine.info.maxContextLength;
    if (promptTokenIds.length >= maxContext) {
      return this.reject(
        route,
        {
          code: 'context_length_exceeded',
          message: `This model's maximum context length is ${maxContext} tokens. However, your prompt is ${promptTokenIds.length} tokens long.`,
          param: 'prompt',
        },
        logger,
      );
    }
    const maxTokens =
      job.sampling.maxTokens ?? (job.defaultMaxTokens === 'context' ? maxContext - promptTokenIds.length : job.defaultMaxTokens);
    if (promptTokenIds.length + maxTokens > maxContext) {
      return this.reject(
        route,
        {
          code: 'context_length_exceeded',
          message:
            `This model's maximum context length is ${maxContext} tokens. However, you requested ` +
            `${promptTokenIds.length + maxTokens} tokens (${promptTokenIds.length} in the prompt, ${maxTokens} for the completion).`,
          param: 'max_tokens',
        },
        logger,
      );
    }

    const [[, cancelled], [, rawMeta]] = ((await state) ?? [[null, 0], [null, {}]]) as [[unknown, number], [unknown, Record<string, string>]];
    timing.checkedAt = epochMs();
    if (cancelled === 1 || signal.aborted) return this.skip(logger);
    const meta = decodeRequestMeta(rawMeta ?? {});
    if (meta !== undefined) {
      route.channel = meta.channel === '' ? null : meta.channel;
      // Its client left while it waited: it runs only for what is left of its grace.
      if (route.channel === null) {
        if (meta.graceMs - (Date.now() - (meta.detachedAt ?? 0)) <= 0) return this.skip(logger);
        router.detach(route.requestId, null, meta.detachedAt);
      }
    }

    // zod's optional fields may hold `undefined`; the engine's options must not.
    const sampling = Object.fromEntries(
      Object.entries({ ...job.sampling, maxTokens }).filter(([, value]) => value !== undefined),
    ) as SamplingParams;
    try {
      engine.submit({ id: job.requestId, promptTokenIds, sampling }, signal);
    } catch (error) {
      if (isEngineError(error)) return this.reject(route, toWireError(error.code, error.message), logger);
      throw error;
    }
    timing.submittedAt = epochMs();
    router.push(route, { type: 'accepted', workerId: this.deps.workerId, promptTokens: promptTokenIds.length });
    this.counters.running++;
    route.startedAt = performance.now();
    const onCancel = () => (route.cancelledAt = performance.now());
    signal.addEventListener('abort', onCancel, { once: true });
    return true;
  }

  /** The engine's finish event: metrics, the log line, and the request's last entry. */
  private finish(route: Route, event: Extract<EngineEvent, { type: 'finish' }>, signal: AbortSignal, logger: Logger, timing: ProcessTiming): void {
    this.counters.running--;
    if (route.cancelledAt !== undefined) {
      this.counters.lastCancel = { requestId: route.requestId, ms: Math.round(performance.now() - route.cancelledAt) };
    }
    const finishReason = signal.aborted ? 'abort' : event.error !== undefined ? 'error' : (route.lastFinishReason ?? 'stop');
    this.deps.hooks?.requestFinished?.({ finishReason, usage: event.usage, timings: event.timings });
    logger.info(
      {
        outcome: finishReason,
        ...(signal.aborted ? { abortReason: String(signal.reason) } : {}),
        promptTokens: event.usage.promptTokens,
        completionTokens: event.usage.completionTokens,
        ms: Math.round(performance.now() - (route.startedAt ?? 0)),
        timing: timingFields(timing, event.timings),
      },
      'request finished',
    );
    const { router } = this.deps;
    if (signal.aborted && signal.reason === SHUTDOWN_REASON) {
      // A drain tells the client why its stream ends.
      router.push(route, { type: 'error', error: { code: 'worker_shutdown', message: 'The worker shut down.', param: null } });
    } else if (signal.aborted && signal.reason === REDIS_UNAVAILABLE) {
      // Entries were lost while Redis was away: the answer cannot be completed, and says so.
      router.push(route, { type: 'error', error: { code: 'worker_lost', message: 'The worker lost its connection to Redis.', param: null } });
    } else if (signal.aborted && signal.reason === 'superseded') {
      // A newer attempt owns the request: this one writes nothing more.
    } else if (!signal.aborted && event.error !== undefined) {
      logger.error({ code: event.error.code, message: event.error.message }, 'engine error');
      router.push(route, { type: 'error', error: toWireError(event.error.code, event.error.message) });
    } else {
      // A cancel ends the log like an answer (its choices ended `abort`): a late resume sees why it ended.
      router.push(route, { type: 'finish', usage: event.usage });
    }
  }

  private skip(logger: Logger): false {
    this.counters.skipped++;
    logger.info({ outcome: 'skipped' }, 'skipped a cancelled or expired job');
    return false;
  }

  /** The prompt's token ids: gateways tokenize (a large prompt must not stall this thread's I/O). */
  private encode(job: GenerateJob): number[] | WireError {
    const input = job.input;
    if (input.kind !== 'tokens') {
      return { code: 'invalid_request', message: 'This worker takes prompt token ids only: the gateway is older than the worker.', param: 'prompt' };
    }
    if (input.promptTokenIds.length === 0) return { code: 'invalid_request', message: 'The prompt is empty.', param: 'prompt' };
    return input.promptTokenIds;
  }

  private reject(route: Route, error: WireError, logger: Logger): false {
    logger.info({ outcome: 'rejected', code: error.code }, 'request rejected');
    this.deps.router.push(route, { type: 'rejected', error });
    return false;
  }
}
