import { randomInt } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import type { Engine, EngineErrorCode, EngineEvent, SamplingParams } from '@sluice/engine';
import {
  cancelReasonSchema,
  decodeRequestMeta,
  generateJobSchema,
  openChoices,
  readLog,
  resolveMaxTokens,
  sentTokens,
  type GenerateJob,
  type RedisNames,
  type WireError,
} from '@sluice/protocol';
import type { ControlListener } from './control-listener.js';
import { REDIS_UNAVAILABLE, type Route, type RouteTiming, type StepRouter } from './step-router.js';
import type { RequestHandover } from './handover.js';

type FinishEvent = Extract<EngineEvent, { type: 'finish' }>;

/** The reason a forced shutdown passes to `abort()`: the client gets `worker_shutdown` instead of silence. */
export const SHUTDOWN_REASON = 'worker_shutdown';

/** The reason a job whose checks failed after the engine took it passes to `abort()` (see `start`). */
export const SKIPPED_REASON = 'skipped';

/** An abort reason that is a cancel from a gateway (a control message), not this worker's own stop. */
const isCancel = (reason: unknown): boolean => cancelReasonSchema.safeParse(reason).success;

/** The reason a drain passes to `abort()` at its bound: the request moves to another worker ({@link RequestHandover}). */
export const HANDOVER_REASON = 'worker_draining';

/** How long a request whose entries Redis lost waits for Redis to return before its stream ends `worker_lost`. */
const RECOVERY_WAIT_MS = 30_000;
/** How long a handover that Redis refused waits before it tries again. */
const HANDOVER_RETRY_MS = 200;

/** The last entries of a stream this worker stops: drained or shut down, or cut off from Redis. */
const WORKER_SHUTDOWN: WireError = { code: 'worker_shutdown', message: 'The worker shut down.', param: null };
const REDIS_LOST: WireError = { code: 'worker_lost', message: 'The worker lost its connection to Redis.', param: null };

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
  /** Moves a request to another worker (see `handover.ts`); without it a drain ends the streams. */
  handover?: Pick<RequestHandover, 'handOver'>;
}

/**
 * Job → prompt tokens → validate → accepted/rejected → engine.submit; the step router turns the
 * request's engine events into entries, and the job settles when its sequence finishes. A job retried
 * after its first worker died mid-answer is not run again: its client already got part of an answer,
 * so the stream fails instead of restarting.
 */
export class JobProcessor {
  readonly counters: ProcessorCounters = { running: 0, processed: 0, skipped: 0, lastCancel: undefined };
  /** The job of each request running here: routes, controls and engine ids are keyed by request id. */
  readonly #local = new Map<string, { attempt: number; supersede: () => void; settled: Promise<void> }>();

  constructor(private readonly deps: ProcessorDeps) {}

  /**
   * @param bullAttempt BullMQ's `attemptsStarted`: 1 for the first run; more when BullMQ recovered
   *   the job after its worker died (stalled), and its client may already hold part of an answer.
   */
  async process(data: unknown, bullAttempt: number, bullSignal?: AbortSignal): Promise<void> {
    const parsed = generateJobSchema.safeParse(data);
    if (!parsed.success) {
      this.deps.logger.error({ issues: parsed.error.issues.slice(0, 3) }, 'malformed job dropped');
      return;
    }
    const job = parsed.data;
    const timing: ProcessTiming = { pickedUpAt: epochMs() };
    // `requestId` is the id the client sees (x-request-id); `jobId` is the gateway's unique one.
    const log = this.deps.logger.child({ requestId: job.correlationId ?? job.requestId, jobId: job.requestId });
    const attempt = job.continuation?.attempt ?? 1;
    const previous = this.#local.get(job.requestId);
    if (previous !== undefined) {
      // This worker still runs the request: a redelivery of the same attempt has nothing to add, and
      // a newer attempt (this worker was taken for dead and was not) waits for the old one to stop, as
      // a fenced-out attempt would, so that only one attempt's events are routed here at a time.
      if (previous.attempt >= attempt) {
        this.skip(log, 'already running here');
        return;
      }
      previous.supersede();
      await previous.settled;
    }
    const controller = new AbortController();
    let settle!: () => void;
    const local = { attempt, supersede: () => controller.abort('superseded'), settled: new Promise<void>((resolve) => (settle = resolve)) };
    this.#local.set(job.requestId, local);
    const onBullAbort = () => controller.abort(SHUTDOWN_REASON);
    bullSignal?.addEventListener('abort', onBullAbort, { once: true });
    this.deps.controls.register(job.requestId, controller);
    controller.signal.addEventListener(
      'abort',
      () => {
        // A drain, or entries lost while Redis was away: another worker carries the stream on from its log.
        const reason: unknown = controller.signal.reason;
        if ((reason === HANDOVER_REASON || reason === REDIS_UNAVAILABLE) && this.deps.handover !== undefined) route.handingOver = true;
      },
      { once: true },
    );
    let finished!: () => void;
    const done = new Promise<void>((resolve) => (finished = resolve));
    // A continuation's choices run as one engine request each; the request ends when all have.
    const parts = { left: 1, completionTokens: 0, error: undefined as FinishEvent['error'] };
    const route = this.deps.router.open({
      requestId: job.requestId,
      channel: job.channel,
      attempt,
      deadlineAt: job.deadlineAt,
      graceMs: job.resumeGraceMs,
      nextSeq: 0,
      timing,
      abort: (reason) => controller.abort(reason),
      onFinish: (event) => {
        parts.completionTokens += event.usage.completionTokens;
        parts.error ??= event.error;
        if (--parts.left > 0) return;
        const whole: FinishEvent = {
          ...event,
          usage: { promptTokens: event.usage.promptTokens, completionTokens: parts.completionTokens },
        };
        if (parts.error !== undefined) whole.error = parts.error;
        this.finish(route, whole, controller.signal, log, timing);
        finished();
      },
    });
    try {
      const started = await this.start(job, bullAttempt, route, controller.signal, log, timing);
      if (started !== false) {
        parts.left = started.parts;
        parts.completionTokens = started.priorTokens;
        await done;
        if (route.handingOver === true) await this.handOver(job, route, controller.signal.reason === REDIS_UNAVAILABLE, log);
      }
    } catch (error) {
      log.error({ err: error }, 'job failed');
      this.deps.router.push(route, { type: 'error', error: { code: 'internal', message: 'The worker failed.', param: null } });
    } finally {
      bullSignal?.removeEventListener('abort', onBullAbort);
      this.deps.controls.unregister(job.requestId);
      // The job settles once Redis has its last entries: a job gone from BullMQ means a log that says
      // how the request ended. The job's completion goes on BullMQ's connection, the entries on the
      // router's, and Redis serves a client that sent much (a backlog after a stall) a slice per turn:
      // settled at once, the job could be gone while its ending was still unread, and a gateway that
      // took this worker for lost found nothing to move and no ending (`worker_lost`).
      await this.deps.router.drained();
      this.deps.router.close(route);
      this.counters.processed++;
      if (this.#local.get(job.requestId) === local) this.#local.delete(job.requestId);
      settle();
    }
  }

  /**
   * Validates and submits the request: false when it never reached the engine, else how many engine
   * requests it became and the completion tokens of choices a lost worker already finished.
   */
  private async start(
    job: GenerateJob,
    bullAttempt: number,
    route: Route,
    signal: AbortSignal,
    logger: Logger,
    timing: ProcessTiming,
  ): Promise<false | { parts: number; priorTokens: number }> {
    const { redis, names, engine, router } = this.deps;
    if (signal.aborted || Date.now() >= job.deadlineAt) return this.skip(logger);

    logger.debug({ pickupMs: Date.now() - job.enqueuedAt }, 'job started');
    // The cancel marker (a client that left while the job waited), the request's meta (its route,
    // its attempt) and, for a continuation, its log are read while the prompt is prepared (and, for a
    // first attempt, while the engine starts on it), and checked before anything of it is written.
    const reads = redis.multi().exists(names.cancelMarkerKey(job.requestId)).hgetall(names.metaKey(job.requestId));
    if (job.continuation !== undefined) reads.xrange(names.logKey(job.requestId), '-', '+');
    const state = reads.exec();
    state.catch(() => undefined);
    const encoded = this.encode(job);
    const maxContext = engine.info.maxContextLength;
    const promptTokenIds = Array.isArray(encoded) ? encoded : [];
    const maxTokens = resolveMaxTokens(job.sampling.maxTokens, job.defaultMaxTokens, {
      promptTokens: promptTokenIds.length,
      maxContextLength: maxContext,
      maxCachedTokens: engine.info.maxCachedTokens,
      n: job.sampling.n ?? 1,
    });
    const refusal = Array.isArray(encoded) ? lengthRefusal(promptTokenIds.length, maxTokens, maxContext) : encoded;
    // A first attempt is refused now (its log is empty); a continuation (a worker with a smaller
    // context than the lost one's) once its log is read: its rejection goes after the entries there,
    // not over the first of them (the append failed, and the stream hung until its idle timeout).
    if (refusal !== undefined && job.continuation === undefined) return this.reject(route, refusal, logger);

    // zod's optional fields may hold `undefined`; the engine's options must not.
    const sampling = Object.fromEntries(
      Object.entries({ ...job.sampling, maxTokens }).filter(([, value]) => value !== undefined),
    ) as SamplingParams;
    // Every sampled request runs with a seed, so that a continuation elsewhere draws the same numbers.
    const seed = sampling.seed ?? randomInt(2 ** 31);

    // A first attempt starts in the engine now, while the checks' round trip is out (TTFT): what the
    // engine makes waits behind the router's gate until they pass, and is dropped if they do not.
    /** Submits a request that starts from its first token; what the engine refused, if it did. */
    const submitFromStart = (): Error | undefined => {
      try {
        engine.submit({ id: job.requestId, promptTokenIds, sampling: { ...sampling, seed } }, signal);
        timing.submittedAt = epochMs();
        return undefined;
      } catch (error) {
        return error instanceof Error ? error : new Error(String(error));
      }
    };
    const early = bullAttempt === 1 && job.continuation === undefined && !signal.aborted;
    let submitError: Error | undefined;
    if (early) {
      router.hold(route);
      submitError = submitFromStart();
      // Never reached the engine: no event will come, nothing is held.
      if (submitError !== undefined) router.release(route);
    }
    const started = early && submitError === undefined;
    const skip = (why?: string) => {
      if (!started) return this.skip(logger, why);
      // The engine has it: stop it; its finish (dropped by the gate like everything else) settles the job.
      router.drop(route, SKIPPED_REASON);
      this.skip(logger, why);
      return { parts: 1, priorTokens: 0 };
    };

    let replies: Array<[unknown, unknown]>;
    try {
      replies = (await state) ?? [];
    } catch (error) {
      // The checks could not be read: the job fails (`internal`), and the engine must not go on with it.
      if (started) router.drop(route, SKIPPED_REASON);
      throw error;
    }
    timing.checkedAt = epochMs();
    const cancelled = replies[0]?.[1] === 1;
    const meta = decodeRequestMeta((replies[1]?.[1] as Record<string, string> | undefined) ?? {});
    if (cancelled || isCancel(signal.reason)) {
      // Cancelled while the job waited, but this worker took it before the queue could drop it: the
      // canceller found nothing to remove and wrote nothing, so the answer's end is written here.
      const outcome = skip();
      // (A first attempt BullMQ retried may have written entries before its worker died: it stays silent.)
      if (meta !== undefined && meta.attempt === route.attempt && (bullAttempt === 1 || job.continuation !== undefined)) {
        this.endCancelled(job, route, meta.channel, promptTokenIds.length, replies[2]?.[1] as Array<[string, string[]]> | undefined);
      }
      return outcome;
    }
    if (signal.aborted) return skip();
    if (meta !== undefined && meta.attempt > route.attempt) {
      // A newer attempt (a continuation elsewhere) owns the request: this job was superseded.
      return skip('superseded');
    }
    // A BullMQ retry: the job's worker died (its lock expired). One that no worker accepted streamed
    // nothing and simply runs; one that streamed must not start again from token 0.
    if (bullAttempt > 1 && job.continuation === undefined && (meta === undefined || meta.workerId !== undefined)) {
      if (meta?.workerId !== undefined && this.deps.handover !== undefined) {
        // No gateway has moved it on yet: this worker makes the gateways' fenced move itself (from the
        // meta's worker id; a gateway trying it too finds it moved), so the stream continues from its
        // log. A first attempt's move is the first migration, allowed under any MAX_MIGRATIONS ≥ 1.
        const result = await this.deps.handover.handOver(job, route.attempt, meta.channel, meta.workerId, 1);
        if (result.moved) return this.skip(logger, 'recovered: continued as a new attempt');
        if (result.attempt > route.attempt) return this.skip(logger, 'superseded');
      }
      this.counters.skipped++;
      // It could not be moved on: the stream fails instead of restarting.
      logger.warn('job retried after a worker was lost: failing its stream');
      router.push(route, {
        type: 'error',
        error: { code: 'worker_lost', message: 'The worker serving the request stopped.', param: null },
      });
      return false;
    }
    // A route message that came while the checks were out is newer than the meta they read.
    if (meta !== undefined && route.moved !== true) {
      route.channel = meta.channel === '' ? null : meta.channel;
      // Its client left while it waited: it runs only for what is left of its grace.
      if (route.channel === null) {
        if (meta.graceMs - (Date.now() - (meta.detachedAt ?? 0)) <= 0) return skip();
        router.detach(route.requestId, null, meta.detachedAt);
      }
    }

    const accepted = { type: 'accepted' as const, workerId: this.deps.workerId, promptTokens: promptTokenIds.length };
    if (job.continuation !== undefined && meta === undefined) return this.skip(logger, 'log lost');
    const log =
      job.continuation === undefined ? undefined : readLog(replies[2]?.[1] as Array<[string, string[]]> | undefined, sampling.n ?? 1);
    if (log?.ended === true) return this.skip(logger, 'already ended');
    // A continuation of which nothing was logged (its worker was lost after it took the job, before it
    // accepted it) starts afresh below, as a first attempt does: its client has nothing of it yet.
    if (log !== undefined && log.lastSeq >= 0) {
      route.nextSeq = log.lastSeq + 1;
      if (!log.whole) {
        // Its cap trimmed the log's start: the tokens (and seed) sent before are not all there to go
        // on from, and a continuation from what is left would not follow what the client has.
        this.counters.skipped++;
        logger.warn({ lastSeq: log.lastSeq }, "continuation impossible: the request's log lost its start");
        router.push(route, {
          type: 'error',
          error: {
            code: 'worker_lost',
            message: "The worker serving the request stopped, and the request's log no longer holds its start.",
            param: null,
          },
        });
        return false;
      }
      if (refusal !== undefined) return this.reject(route, refusal, logger);
      const seed = log.seed ?? sampling.seed;
      const open = openChoices(log);
      let submitted = 0;
      try {
        for (const index of open) {
          const partId = `${job.requestId}#${index}`;
          router.alias(route, partId);
          engine.submit(
            {
              id: partId,
              promptTokenIds,
              sampling: { ...sampling, n: 1, ...(seed === undefined ? {} : { seed }) },
              continuation: { choiceIndex: index, generatedTokenIds: log.choices[index]!.tokenIds },
            },
            signal,
          );
          submitted++;
        }
      } catch (error) {
        // The choices already submitted must not decode on for a request that ends here.
        if (submitted > 0) route.abort('rejected');
        if (isEngineError(error)) return this.reject(route, toWireError(error.code, error.message), logger);
        throw error;
      }
      timing.submittedAt = epochMs();
      logger.info({ attempt: route.attempt, fromSeq: route.nextSeq, choices: open.length }, 'continuing a request of a lost worker');
      router.push(route, { ...accepted, ...(seed === undefined ? {} : { seed }), continued: true });
      this.running(route, signal);
      const priorTokens = log.choices.reduce((sum, choice) => sum + (choice.ended ? choice.tokenIds.length : 0), 0);
      return { parts: open.length, priorTokens };
    }

    // (A first attempt's refusal went out above.)
    if (refusal !== undefined) return this.reject(route, refusal, logger);
    // A first attempt was submitted early (above); any other (a BullMQ retry, a continuation of nothing) is submitted now.
    const refused = early ? submitError : submitFromStart();
    if (refused !== undefined) {
      if (isEngineError(refused)) return this.reject(route, toWireError(refused.code, refused.message), logger);
      throw refused;
    }
    router.push(route, { ...accepted, seed });
    this.running(route, signal);
    // Held events (an early start) follow the `accepted`, in the same command.
    router.release(route);
    return { parts: 1, priorTokens: 0 };
  }

  /**
   * After a drain stopped the request, or Redis went away while its entries were written (they are lost,
   * but its log and meta may have outlived the outage: a Redis with persistence): once Redis answers
   * and everything written for it is in its log, another worker (this one too) continues it from the
   * log, token-identical. If it cannot move (no Redis within {@link RECOVERY_WAIT_MS}, or its meta is
   * gone: a Redis restarted empty), its stream ends as before (`worker_shutdown`, `worker_lost`).
   */
  private async handOver(job: GenerateJob, route: Route, redisLost: boolean, logger: Logger): Promise<void> {
    const { router, handover } = this.deps;
    // Redis may be away or refuse writes for a moment (a restart, out of memory): the move is tried
    // again until it is made or known impossible, for up to RECOVERY_WAIT_MS (a refused move used to
    // end the streams of a drain at once).
    const until = Date.now() + Math.min(RECOVERY_WAIT_MS, Math.max(0, job.deadlineAt - Date.now()));
    let moved = false;
    // (A request whose log lacks entries its client has cannot be continued from the log.)
    while (handover !== undefined && route.logBehind !== true) {
      try {
        if (redisLost && !(await router.whenAnswering(until - Date.now()))) break;
        // (Appends that failed with the connection settle as failed; nothing of them is waited for.)
        await router.drained().catch(() => undefined);
        moved = (await handover.handOver(job, route.attempt, route.channel ?? '')).moved;
        break;
      } catch (error) {
        logger.warn({ err: error }, 'handing the request over failed');
        if (Date.now() + HANDOVER_RETRY_MS >= until) break;
        await sleep(HANDOVER_RETRY_MS);
      }
    }
    if (moved) {
      logger.info({ attempt: route.attempt + 1 }, redisLost ? 'handed over after a Redis outage' : 'handed over to another worker (drain)');
      return;
    }
    route.handingOver = false;
    this.endWith(route, redisLost ? REDIS_LOST : WORKER_SHUTDOWN);
  }

  /** Ends the stream with `error`, also one whose entries Redis lost (its last entry is written if Redis takes it). */
  private endWith(route: Route, error: WireError): void {
    route.lost = false;
    this.deps.router.push(route, { type: 'error', error });
  }

  private running(route: Route, signal: AbortSignal): void {
    this.counters.running++;
    route.startedAt = performance.now();
    signal.addEventListener('abort', () => (route.cancelledAt = performance.now()), { once: true });
  }

  /** The engine's finish event: metrics, the log line, and the request's last entry. */
  private finish(route: Route, event: FinishEvent, signal: AbortSignal, logger: Logger, timing: ProcessTiming): void {
    // Stopped by its checks after the engine took it: counted and logged as skipped, nothing to write.
    if (route.gate === 'dropping') return;
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
      this.endWith(route, WORKER_SHUTDOWN);
    } else if (signal.aborted && (signal.reason === 'superseded' || route.handingOver === true)) {
      // A newer attempt owns the request (or is about to: a drain, or a Redis outage, hands it over):
      // nothing more from here.
    } else if (signal.aborted && signal.reason === REDIS_UNAVAILABLE) {
      // Entries were lost while Redis was away (and no handover here): the answer cannot be completed, and says so.
      this.endWith(route, REDIS_LOST);
    } else if (!signal.aborted && event.error !== undefined) {
      logger.error({ code: event.error.code, message: event.error.message }, 'engine error');
      router.push(route, { type: 'error', error: toWireError(event.error.code, event.error.message) });
    } else {
      // A cancel ends the log like an answer (its choices ended `abort`): a late resume sees why it ended.
      router.push(route, { type: 'finish', usage: event.usage });
    }
  }

  /**
   * Ends a cancelled request that never ran here as its canceller would have: every open choice
   * `abort`, then `finish` — after an `accepted` for a first attempt, after what its log holds for a
   * continuation — so its stream (or a later resume) ends now, not at a timeout.
   * @param channel the request's route from its meta ('' = detached)
   * @param range a continuation's log (XRANGE), read with the checks
   */
  private endCancelled(
    job: GenerateJob,
    route: Route,
    channel: string,
    promptTokens: number,
    range: Array<[string, string[]]> | undefined,
  ): void {
    const { router, workerId } = this.deps;
    const n = job.sampling.n ?? 1;
    route.channel = channel === '' ? null : channel;
    let open = Array.from({ length: n }, (_, index) => index);
    let completionTokens = 0;
    if (job.continuation === undefined) {
      router.push(route, { type: 'accepted', workerId, promptTokens });
    } else {
      const log = readLog(range, n);
      if (log.ended || log.lastSeq < 0) return;
      // (With its start trimmed, the usage counts what is left: the ending still goes out.)
      route.nextSeq = log.lastSeq + 1;
      open = openChoices(log);
      completionTokens = sentTokens(log);
    }
    for (const index of open) router.push(route, { type: 'text-end', index, finishReason: 'abort' });
    router.push(route, { type: 'finish', usage: { promptTokens, completionTokens } });
  }

  private skip(logger: Logger, why = 'cancelled or expired'): false {
    this.counters.skipped++;
    logger.info({ outcome: 'skipped', why }, 'skipped a job');
    return false;
  }

  /** The prompt's token ids: gateways tokenize (a large prompt must not stall this thread's I/O). */
  private encode(job: GenerateJob): number[] | WireError {
    const input = job.input;
    if (input.kind !== 'tokens') {
      return {
        code: 'invalid_request',
        message: 'This worker takes prompt token ids only: the gateway is older than the worker.',
        param: 'prompt',
      };
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

/** The request cannot fit this worker's context: its prompt alone, or with its completion. */
function lengthRefusal(promptTokens: number, maxTokens: number, maxContext: number): WireError | undefined {
  if (promptTokens >= maxContext) {
    return {
      code: 'context_length_exceeded',
      message: `This model's maximum context length is ${maxContext} tokens. However, your prompt is ${promptTokens} tokens long.`,
      param: 'prompt',
    };
  }
  if (promptTokens + maxTokens > maxContext) {
    return {
      code: 'context_length_exceeded',
      message:
        `This model's maximum context length is ${maxContext} tokens. However, you requested ` +
        `${promptTokens + maxTokens} tokens (${promptTokens} in the prompt, ${maxTokens} for the completion).`,
      param: 'max_tokens',
    };
  }
  return undefined;
}
