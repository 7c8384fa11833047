import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import type { Engine, EngineErrorCode, SamplingParams } from '@sluice/engine';
import {
  generateJobSchema,
  type GatewayEntryDraft,
  type GenerateJob,
  type RedisNames,
  type TokenLogprobWire,
  type WireError,
} from '@sluice/protocol';
import type { CancelListener } from './cancel-listener.js';
import type { PromptEncoder } from './prompt-encoder.js';
import type { StepPublisher } from './step-publisher.js';

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

export interface ProcessorDeps {
  engine: Pick<Engine, 'generate' | 'info'>;
  prompts: PromptEncoder;
  publisher: StepPublisher;
  cancels: CancelListener;
  /** Command connection (markers). */
  redis: Redis;
  names: RedisNames;
  workerId: string;
  logger: Logger;
  hooks?: WorkerHooks;
}

/**
 * Job → prompt tokens → validate → accepted/rejected → engine.generate → entries per step. The job
 * settles when its sequence finishes. A job retried after its first worker died mid-answer is not run
 * again: its client already got part of an answer, so the stream fails instead of restarting.
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
    // `requestId` is the id the client sees (x-request-id); `jobId` is the gateway's unique one.
    const log = this.deps.logger.child({ requestId: job.correlationId ?? job.requestId, jobId: job.requestId });
    const controller = new AbortController();
    const onBullAbort = () => controller.abort(SHUTDOWN_REASON);
    bullSignal?.addEventListener('abort', onBullAbort, { once: true });
    this.deps.cancels.register(job.requestId, controller);
    try {
      await this.run(job, attempt, controller.signal, log);
    } catch (error) {
      log.error({ err: error }, 'job failed');
      this.send(job, { type: 'error', error: { code: 'internal', message: 'The worker failed.', param: null } });
    } finally {
      bullSignal?.removeEventListener('abort', onBullAbort);
      this.deps.cancels.unregister(job.requestId);
      this.deps.publisher.forget(job.requestId);
      this.counters.processed++;
    }
  }

  private async run(job: GenerateJob, attempt: number, signal: AbortSignal, logger: Logger): Promise<void> {
    const { redis, names, engine } = this.deps;
    const startedAt = performance.now();
    if (signal.aborted || Date.now() >= job.deadlineAt) return this.skip(logger);
    if (attempt > 1) {
      this.counters.skipped++;
      // A retry (stalled-job recovery): the first attempt may have streamed tokens already.
      logger.warn('job retried after a worker was lost: failing its stream');
      this.send(job, { type: 'error', error: { code: 'worker_lost', message: 'The worker serving the request stopped.', param: null } });
      return;
    }

    logger.debug({ pickupMs: Date.now() - job.enqueuedAt }, 'job started');
    // The cancel marker (a client that left while the job waited) is read while the prompt is
    // prepared, and checked before the engine sees the request.
    const cancelled = redis.exists(names.cancelMarkerKey(job.requestId));
    cancelled.catch(() => undefined);
    const promptTokenIds = this.encode(job, logger);
    if (!Array.isArray(promptTokenIds)) return this.reject(job, promptTokenIds, logger);
    const maxContext = engine.info.maxContextLength;
    if (promptTokenIds.length >= maxContext) {
      return this.reject(
        job,
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
        job,
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

    // zod's optional fields may hold `undefined`; the engine's options must not.
    if ((await cancelled) === 1 || signal.aborted) return this.skip(logger);

    const sampling = Object.fromEntries(
      Object.entries({ ...job.sampling, maxTokens }).filter(([, value]) => value !== undefined),
    ) as SamplingParams;
    let events: AsyncIterable<import('@sluice/engine').EngineEvent>;
    try {
      events = engine.generate({ id: job.requestId, promptTokenIds, sampling }, signal);
    } catch (error) {
      if (isEngineError(error)) return this.reject(job, toWireError(error.code, error.message), logger);
      throw error;
    }

    this.send(job, { type: 'accepted', workerId: this.deps.workerId, promptTokens: promptTokenIds.length });
    this.counters.running++;
    let cancelledAt: number | undefined;
    let lastFinishReason: 'stop' | 'length' | undefined;
    const onCancel = () => (cancelledAt = performance.now());
    signal.addEventListener('abort', onCancel, { once: true });
    // Tokens per choice whose text the detokenizer still holds back (an incomplete UTF-8 sequence):
    // they ride on the next delta of that choice, so the tokens a gateway writes add up to the
    // tokens generated.
    const heldTokens: number[] = [];
    try {
      for await (const event of events) {
        switch (event.type) {
          case 'text-delta': {
            const tokens = event.tokenIds.length + (heldTokens[event.index] ?? 0);
            if (event.text === '' && event.logprobs === undefined) {
              heldTokens[event.index] = tokens;
              break;
            }
            heldTokens[event.index] = 0;
            this.send(job, {
              type: 'text-delta',
              index: event.index,
              text: event.text,
              tokens,
              ...(event.logprobs === undefined ? {} : { logprobs: event.logprobs.map(toWireLogprob) }),
            });
            break;
          }
          case 'text-end':
            if (event.finishReason === 'stop' || event.finishReason === 'length') {
              lastFinishReason = event.finishReason;
              // Tokens whose text never showed (held back to the end): an empty delta carries them.
              const held = heldTokens[event.index] ?? 0;
              if (held > 0) this.send(job, { type: 'text-delta', index: event.index, text: '', tokens: held });
              heldTokens[event.index] = 0;
              this.send(job, { type: 'text-end', index: event.index, finishReason: event.finishReason });
            }
            break;
          case 'finish': {
            const finishReason = signal.aborted ? 'abort' : event.error !== undefined ? 'error' : (lastFinishReason ?? 'stop');
            this.deps.hooks?.requestFinished?.({ finishReason, usage: event.usage, timings: event.timings });
            logger.info(
              {
                outcome: finishReason,
                ...(signal.aborted ? { abortReason: String(signal.reason) } : {}),
                promptTokens: event.usage.promptTokens,
                completionTokens: event.usage.completionTokens,
                ms: Math.round(performance.now() - startedAt),
              },
              'request finished',
            );
            if (signal.aborted) {
              // A client-side cancel needs no answer; a drain tells the client why its stream ends.
              if (signal.reason === SHUTDOWN_REASON) {
                this.send(job, { type: 'error', error: { code: 'worker_shutdown', message: 'The worker shut down.', param: null } });
              }
            } else if (event.error !== undefined) {
              logger.error({ code: event.error.code, message: event.error.message }, 'engine error');
              this.send(job, { type: 'error', error: toWireError(event.error.code, event.error.message) });
            } else {
              this.send(job, { type: 'finish', usage: event.usage });
            }
            break;
          }
        }
      }
    } finally {
      this.counters.running--;
      signal.removeEventListener('abort', onCancel);
      if (cancelledAt !== undefined) {
        this.counters.lastCancel = { requestId: job.requestId, ms: Math.round(performance.now() - cancelledAt) };
      }
    }
  }

  private skip(logger: Logger): void {
    this.counters.skipped++;
    logger.info({ outcome: 'skipped' }, 'skipped a cancelled or expired job');
  }

  private encode(job: GenerateJob, logger: Logger): number[] | WireError {
    try {
      const input = job.input;
      const ids =
        input.kind === 'chat'
          ? this.deps.prompts.chat(
              input.messages.map((m) => (m.name === undefined ? { role: m.role, content: m.content } : { role: m.role, content: m.content, name: m.name })),
            )
          : input.kind === 'text'
            ? this.deps.prompts.text(input.prompt)
            : input.promptTokenIds;
      if (ids.length === 0) return { code: 'invalid_request', message: 'The prompt is empty.', param: 'prompt' };
      return ids;
    } catch (error) {
      logger.warn({ err: error }, 'prompt encoding failed');
      return { code: 'invalid_request', message: 'The messages cannot be rendered with the model chat template.', param: 'prompt' };
    }
  }

  private reject(job: GenerateJob, error: WireError, logger: Logger): void {
    logger.info({ outcome: 'rejected', code: error.code }, 'request rejected');
    this.send(job, { type: 'rejected', error });
  }

  private send(job: GenerateJob, entry: DistributiveOmit<GatewayEntryDraft, 'requestId'>): void {
    this.deps.publisher.push(job.channel, { ...entry, requestId: job.requestId } as GatewayEntryDraft);
  }
}

type DistributiveOmit<T, K extends PropertyKey> = T extends unknown ? Omit<T, K> : never;

function toWireLogprob(lp: import('@sluice/engine').TokenLogprob): TokenLogprobWire {
  const out: TokenLogprobWire = { token: lp.token, logprob: lp.logprob };
  if (lp.topLogprobs !== undefined) out.top = lp.topLogprobs.map((t) => ({ token: t.token, logprob: t.logprob }));
  return out;
}
