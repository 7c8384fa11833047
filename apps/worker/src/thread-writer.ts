/**
 * The worker's step sink (`EngineOptions.stepSink`): runs on the engine thread and writes the entries
 * of the requests the step router hands it — one command a step, as the router would — so that the
 * worker's host thread is not woken for every step. The router keeps everything else (routes, checks,
 * the request's end): it tells this writer what to do ({@link WriterCommand}) and hears what Redis said
 * ({@link WriterReport}).
 */
import { Redis } from 'ioredis';
import type { EngineEvent, StepSink, StepSinkSpec } from '@sluice/engine';
import { RequestScripts, redisNames } from '@sluice/protocol';
import { eventEntries, type EntryDraft, type EntryState } from './event-entries.js';
import { StepBatch } from './step-batch.js';
import type { ReturnedRequest, WriterCommand, WriterReport } from './thread-writer-messages.js';

export interface ThreadWriterOptions {
  redisUrl: string;
  redisPrefix: string;
  workerId: string;
  /** How long a finished request's log stays readable. */
  retentionMs: number;
  /** Approximate cap on a log's entries (XADD MAXLEN ~). */
  maxLogEntries: number;
  connectionName: string;
  /** The longest wait between reconnect attempts. */
  reconnectMaxMs: number;
}

/** A request whose entries this writer writes. */
interface Written extends EntryState {
  readonly requestId: string;
  attempt: number;
  channel: string | null;
  nextSeq: number;
  deadlineAt: number;
  /** holding: its events wait for the checks; writing; dropped: nothing of it is written. */
  phase: 'holding' | 'writing' | 'dropped';
  kept: EngineEvent[];
  /** Its finish went to the host: it is returned once its writes are answered. */
  finished: boolean;
  /** Writes carrying its entries that Redis has not answered yet. */
  writes: number;
  /** Nothing more is written for it: its entries were lost, or it is being handed over. */
  lost: boolean;
  stopped: boolean;
  fenced: boolean;
  logBehind: boolean;
  firstStepAt?: number;
  publishedAt?: number;
}

/** The engine's `stepSink` that runs this writer. */
export function threadWriterSink(options: ThreadWriterOptions): StepSinkSpec {
  return { module: import.meta.url, options };
}

/** The engine thread's entry into this module (`CreateStepSink`): a writer on a connection of its own. */
export function createStepSink(options: unknown, post: (message: unknown) => void): StepSink {
  const o = options as ThreadWriterOptions;
  // As the router's connection: nothing is queued while Redis is away (a step that cannot be written
  // fails now and its requests are handed over), and it reconnects about as soon as Redis is back.
  const redis = new Redis(o.redisUrl, {
    maxRetriesPerRequest: 1,
    enableOfflineQueue: false,
    retryStrategy: (times) => Math.min(50 * times, o.reconnectMaxMs),
    connectionName: o.connectionName,
  });
  // Its failures reach the host as lost requests; the event would otherwise be unhandled.
  redis.on('error', () => undefined);
  return new ThreadWriter(redis, o, post, { ownsConnection: true });
}

export class ThreadWriter implements StepSink {
  readonly #requests = new Map<string, Written>();
  readonly #batch = new StepBatch<Written>();
  readonly #redis: Redis;
  readonly #scripts: RequestScripts;
  readonly #report: (report: WriterReport) => void;
  readonly #ownsConnection: boolean;
  /** Requests whose finish this step carried: returned once the step's write is answered. */
  #finishing: Written[] = [];
  /** Settles once every write sent so far is answered. */
  #writes: Promise<unknown> = Promise.resolve();

  /** `post` carries its {@link WriterReport}s to the step router. */
  constructor(
    redis: Redis,
    private readonly options: Pick<ThreadWriterOptions, 'redisPrefix' | 'workerId' | 'retentionMs' | 'maxLogEntries'>,
    post: (report: WriterReport) => void,
    { ownsConnection = false } = {},
  ) {
    this.#redis = redis;
    this.#report = post;
    this.#ownsConnection = ownsConnection;
    this.#scripts = new RequestScripts(redis, redisNames(options.redisPrefix));
  }

  take(requestId: string, event: EngineEvent): boolean {
    const request = this.#requests.get(requestId);
    if (request === undefined) return false;
    if (event.type === 'finish') {
      // The host settles the request; it writes the end once this writer returns the request to it.
      request.finished = true;
      if (request.phase === 'dropped') this.#requests.delete(requestId);
      else if (request.phase === 'writing') this.#finishing.push(request);
      return false;
    }
    if (event.type === 'text-delta' && event.text !== '') request.firstStepAt ??= epochMs();
    if (request.phase === 'holding' && !request.stopped) request.kept.push(event);
    else if (request.phase === 'writing') this.#add(request, event);
    return true;
  }

  endStep(): void {
    this.#flush();
    const finishing = this.#finishing;
    this.#finishing = [];
    this.#returnWritten(finishing);
  }

  onMessage(message: unknown): void {
    const command = message as WriterCommand;
    const request = this.#requests.get(command.requestId);
    switch (command.type) {
      case 'hold':
        this.#requests.set(command.requestId, {
          requestId: command.requestId,
          attempt: 0,
          channel: null,
          nextSeq: 0,
          deadlineAt: 0,
          phase: 'holding',
          kept: [],
          held: [],
          finished: false,
          writes: 0,
          lost: false,
          stopped: false,
          fenced: false,
          logBehind: false,
        });
        return;
      case 'start': {
        if (request?.phase !== 'holding') return;
        request.phase = 'writing';
        request.channel = command.channel;
        request.attempt = command.attempt;
        request.nextSeq = command.nextSeq;
        request.deadlineAt = command.deadlineAt;
        for (const draft of command.entries) this.#push(request, draft);
        const kept = request.kept;
        request.kept = [];
        for (const event of kept) this.#add(request, event);
        this.#flush();
        if (request.finished) this.#returnWritten([request]);
        return;
      }
      case 'forget':
        this.#requests.delete(command.requestId);
        return;
      case 'drop':
        if (request === undefined) return;
        request.phase = 'dropped';
        request.kept = [];
        if (request.finished) this.#requests.delete(command.requestId);
        return;
      case 'stop':
        if (request === undefined) return;
        request.stopped = true;
        request.kept = [];
        return;
      case 'route':
        if (request !== undefined && !request.fenced) request.channel = command.channel;
        return;
    }
  }

  /** Resolves once Redis has answered every write sent so far. */
  async settled(): Promise<void> {
    await this.#writes;
  }

  async close(): Promise<void> {
    this.#flush();
    await this.settled();
    if (this.#ownsConnection) await this.#redis.quit().catch(() => this.#redis.disconnect());
  }

  #add(request: Written, event: EngineEvent): void {
    for (const draft of eventEntries(request, event)) this.#push(request, draft);
  }

  #push(request: Written, draft: EntryDraft): void {
    if (request.lost || request.stopped) return;
    this.#batch.add(request, request.channel, request.nextSeq++, draft);
  }

  #flush(): void {
    if (this.#batch.empty) return;
    if (this.#redis.status !== 'ready') {
      for (const request of this.#batch.targets()) this.#lose(request, `Redis unavailable (${this.#redis.status})`);
      this.#batch.clear();
      return;
    }
    const { retentionMs, maxLogEntries, workerId } = this.options;
    const now = Date.now();
    const { targets, channels, written } = this.#batch.write(this.#scripts, {
      workerId,
      maxEntries: maxLogEntries,
      // Never the request's last entry (the host writes that): the TTL only bounds a request nobody finishes.
      ttlMs: (request) => Math.max(0, request.deadlineAt - now) + retentionMs,
    });
    for (const request of targets) request.writes++;
    this.#writes = Promise.allSettled([this.#writes, written]);
    written.then(
      ({ appended, receivers }) => {
        const at = epochMs();
        targets.forEach((request, i) => {
          const reply = appended[i]!;
          if (reply === 0 && !request.fenced) {
            request.fenced = true;
            request.channel = null;
            this.#report({ type: 'fenced', requestId: request.requestId });
          } else if (reply instanceof Error && !request.logBehind) {
            // (An append resent after a reconnect that Redis had made before finds its entry there already.)
            if (!reply.message.includes('equal or smaller than the target stream top item')) {
              request.logBehind = true;
              this.#report({ type: 'log-behind', requestId: request.requestId, why: reply.message });
            }
          }
          if (request.firstStepAt !== undefined) request.publishedAt ??= at;
        });
        channels.forEach((channel, i) => {
          if (receivers[i] === 0) this.#report({ type: 'unheard', channel });
        });
        this.#written(targets);
      },
      (error: unknown) => {
        // Which of its entries reached the logs is unknown.
        for (const request of targets) this.#lose(request, error instanceof Error ? error.message : String(error));
        this.#written(targets);
      },
    );
  }

  #written(targets: Written[]): void {
    for (const request of targets) request.writes--;
    this.#returnWritten(targets.filter((request) => request.finished));
  }

  /** Nothing more is written for it; the host stops it and hands it over once Redis answers. */
  #lose(request: Written, why: string): void {
    if (request.lost) return;
    request.lost = true;
    this.#report({ type: 'lost', requestId: request.requestId, why });
  }

  /**
   * Returns those of `requests` whose writes are all answered to the host, in one report: their ends
   * then go in one write. Posted a microtask later at the earliest: after the message carrying their finish.
   */
  #returnWritten(requests: Written[]): void {
    const returned: ReturnedRequest[] = [];
    for (const request of requests) {
      if (request.writes > 0 || this.#requests.get(request.requestId) !== request) continue;
      this.#requests.delete(request.requestId);
      returned.push({
        requestId: request.requestId,
        nextSeq: request.nextSeq,
        ...(request.lastFinishReason === undefined ? {} : { lastFinishReason: request.lastFinishReason }),
        ...(request.firstStepAt === undefined ? {} : { firstStepAt: request.firstStepAt }),
        ...(request.publishedAt === undefined ? {} : { publishedAt: request.publishedAt }),
      });
    }
    if (returned.length > 0) queueMicrotask(() => this.#report({ type: 'returned', requests: returned }));
  }
}

function epochMs(): number {
  return performance.timeOrigin + performance.now();
}
