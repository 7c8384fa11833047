import { setTimeout as sleep } from 'node:timers/promises';
import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import type { EngineEvent, StepEvent } from '@sluice/engine';
import { RequestScripts, type RedisNames } from '@sluice/protocol';
import { eventEntries, type EntryDraft } from './event-entries.js';
import { StepBatch } from './step-batch.js';
import type { ReturnedRequest, WriterCommand, WriterReport } from './thread-writer-messages.js';

export type { EntryDraft } from './event-entries.js';

/** The abort reason of a request whose entries could not be written (Redis unreachable). */
export const REDIS_UNAVAILABLE = 'redis_unavailable';

/** How long a PING may take to say Redis answers again, and how long to wait before the next try. */
const PING_WAIT_MS = 500;
const PING_RETRY_MS = 100;

export interface RouterOptions {
  workerId: string;
  names: RedisNames;
  /** How long a finished request's log stays readable (resume, repair). */
  retentionMs: number;
  /** Approximate cap on a log's entries (XADD MAXLEN ~). */
  maxLogEntries: number;
}

/** One request this worker runs, as the router sees it. */
export interface Route {
  readonly requestId: string;
  /** Where live entries go; null while detached (entries only go to the log). */
  channel: string | null;
  readonly attempt: number;
  /** ms since epoch after which nobody can want the answer: bounds the log's TTL while running. */
  readonly deadlineAt: number;
  /** How long the request may stay detached before it is cancelled. */
  readonly graceMs: number;
  /** Sequence number of the next entry. */
  nextSeq: number;
  /** Stops the request (grace ran out, fenced out by a newer attempt). */
  readonly abort: (reason: string) => void;
  /** Takes the engine's finish event: pushes the request's last entry (finish or error). */
  readonly onFinish: (event: Extract<EngineEvent, { type: 'finish' }>) => void;
  /** Tokens per choice whose text the detokenizer still holds back, and their ids. */
  held: Array<{ tokens: number; ids: number[] } | undefined>;
  /**
   * Its step entries are the thread writer's ({@link StepRouter}): `holding` while its job's checks
   * are out, `writing` until the writer returns it (after its finish).
   */
  sink?: 'holding' | 'writing' | undefined;
  /** Entries pushed here while the writer has it: the `accepted` it writes first, or any the host writes once it is returned. */
  sinkEntries?: EntryDraft[] | undefined;
  /** Its finish, come while the writer still had it: settled once the writer returns it. */
  finishing?: Extract<EngineEvent, { type: 'finish' }> | undefined;
  graceTimer: NodeJS.Timeout | undefined;
  ended: boolean;
  /**
   * Being handed to another worker (a drain): nothing more is written for it here (no `abort` ends;
   * the continuation carries the stream on from the log), but its engine finish still settles the job.
   */
  handingOver?: boolean;
  /** An append of its entries failed: nothing more is written for it (see `StepRouter.#lost`). */
  lost?: boolean;
  /**
   * Redis refused an append of its entries (out of memory) while their publish went out: its client has
   * entries its log lacks, so no continuation from the log can carry its stream on.
   */
  logBehind?: boolean;
  /** Engine request ids routed here besides the request's own. */
  aliases: string[];
  /**
   * A route message (attach, detach) reached the route since it opened: it is newer than what the
   * job's checks read from the meta, which then must not overwrite it.
   */
  moved?: boolean;
  /** The latest choice's stop/length (with n > 1, the last choice to finish decides the outcome). */
  lastFinishReason?: 'stop' | 'length';
  /** performance.now() when the engine took it, and when it was cancelled (metrics, logs). */
  startedAt?: number;
  cancelledAt?: number;
  /** Epoch ms (performance.timeOrigin + now) of the steps before the first token (the TTFT breakdown in the log). */
  timing?: RouteTiming;
  /**
   * The engine started on the request while the job's checks were still out ({@link StepRouter.hold}):
   * its events wait here in order until the checks pass, or are dropped (all but the finish that
   * settles the job) when they fail.
   */
  gate?: { held: EngineEvent[] } | 'dropping' | undefined;
}

/** When the first token reached the router, and when Redis answered the write carrying it. */
export interface RouteTiming {
  firstStepAt?: number;
  publishedAt?: number;
}

/**
 * Routes every engine step as a whole, in one pass: each event becomes a numbered wire entry, and ONE
 * command carries the step ({@link StepBatch}).
 *
 * With a thread writer (the engine's step sink, `thread-writer.ts`), a first attempt's steps are not
 * routed here at all: from its submit to its finish the writer, on the engine thread, writes its
 * entries the same way, so that this thread is not woken for every step. The router holds it back
 * while the job's checks are out (`hold`), then hands it the `accepted` (`release`) or has it write
 * nothing (`drop`), tells it where the request's live entries go, and hears from it what Redis said;
 * once the writer has written everything before the finish it returns the request, and the router
 * writes the end.
 *
 * It also keeps each request's live route: a gateway may move it (a resume on another gateway), detach
 * it (its client left with a resume grace), or die — a PUBLISH that reaches nobody while the gateway's
 * alive key is gone detaches all that gateway's requests. A detached request is cancelled when its
 * grace runs out.
 */
export class StepRouter {
  readonly #routes = new Map<string, Route>();
  readonly #redis: Redis;
  readonly #scripts: RequestScripts;
  /** By route, not request id: an attempt superseded here may still have entries on their way as the next opens. */
  #batch = new StepBatch<Route>();
  /** Sends the thread writer a command; undefined without one (every step is routed here). */
  readonly #writer: ((command: WriterCommand) => void) | undefined;
  /** A flush is set for the next event-loop turn (entries pushed outside a step). */
  #turnFlush = false;
  /** A step (or a gate's release) is being routed: it flushes itself at its end. */
  #routing = false;
  #flushing: Promise<void> = Promise.resolve();
  readonly #checking = new Set<string>();

  constructor(
    redis: Redis,
    private readonly options: RouterOptions,
    private readonly logger: Logger,
    writer?: (command: WriterCommand) => void,
  ) {
    this.#redis = redis;
    this.#scripts = new RequestScripts(redis, options.names);
    this.#writer = writer;
  }

  open(
    route: Omit<Route, 'held' | 'graceTimer' | 'ended' | 'aliases' | 'lastFinishReason' | 'startedAt' | 'cancelledAt' | 'timing'> & {
      timing?: RouteTiming;
    },
  ): Route {
    const full: Route = { ...route, held: [], graceTimer: undefined, ended: false, aliases: [] };
    this.#routes.set(route.requestId, full);
    return full;
  }

  /** Routes the events of another engine request to `route` (a continuation runs one per choice). */
  alias(route: Route, engineRequestId: string): void {
    this.#routes.set(engineRequestId, route);
    route.aliases.push(engineRequestId);
  }

  /** The request's last entry was pushed (or it never started): forget it. */
  close(route: Route): void {
    route.ended = true;
    clearTimeout(route.graceTimer);
    for (const id of [route.requestId, ...route.aliases]) if (this.#routes.get(id) === route) this.#routes.delete(id);
  }

  /**
   * Where the request's meta routes it now (null: detached; undefined: no meta): what a gateway's
   * cancel is checked against before it stops the work.
   */
  async routeOf(requestId: string): Promise<string | null | undefined> {
    const channel = await this.#redis.hget(this.options.names.metaKey(requestId), 'channel');
    return channel === null ? undefined : channel === '' ? null : channel;
  }

  /** Where the request's live entries go now (null: detached; undefined: not running here). */
  channelOf(requestId: string): string | null | undefined {
    return this.#routes.get(requestId)?.channel;
  }

  get size(): number {
    return this.#routes.size;
  }

  /** A whole engine step: the worker's `engine.onEvents` listener. */
  readonly onEvents = (events: ReadonlyArray<StepEvent>): void =>
    this.#routeAndFlush(() => {
      for (const [requestId, event] of events) {
        const route = this.#routes.get(requestId);
        if (route === undefined || route.ended) continue;
        // (The writer takes all but the finish of a request it has.)
        if (route.sink !== undefined && event.type === 'finish') route.finishing = event;
        else if (route.gate !== undefined) this.#gated(route, route.gate, event);
        else this.#routeLogged(route, event);
      }
    });

  /**
   * The route's engine events wait until {@link release} or {@link drop}: its job's checks are still
   * out. Called before the request is submitted: with a thread writer, the writer takes its events
   * from the first (and keeps them meanwhile).
   */
  hold(route: Route): void {
    if (this.#writer === undefined) {
      route.gate = { held: [] };
      return;
    }
    route.sink = 'holding';
    this.#writer({ type: 'hold', requestId: route.requestId });
  }

  /** The submit after {@link hold} failed: nothing of the request will come. */
  unhold(route: Route): void {
    if (route.sink === undefined) {
      route.gate = undefined;
      return;
    }
    this.#writer?.({ type: 'forget', requestId: route.requestId });
    this.#takeBack(route);
  }

  /**
   * The checks passed: the events held meanwhile are routed now, after what the caller pushed (its
   * `accepted`), and leave in one write at once (with a thread writer: it writes them, and everything
   * after, until the finish).
   */
  release(route: Route): void {
    if (route.sink === 'holding') {
      route.sink = 'writing';
      const entries = route.sinkEntries ?? [];
      route.sinkEntries = undefined;
      this.#writer?.({
        type: 'start',
        requestId: route.requestId,
        channel: route.channel,
        attempt: route.attempt,
        nextSeq: route.nextSeq,
        deadlineAt: route.deadlineAt,
        entries,
      });
      return;
    }
    const gate = route.gate;
    route.gate = undefined;
    if (gate === undefined || gate === 'dropping') return;
    this.#routeAndFlush(() => {
      for (const event of gate.held) {
        if (route.ended) break;
        this.#routeLogged(route, event);
      }
    });
  }

  /**
   * Routes a step's events (or a gate's held ones) and sends what they pushed at once: the step is
   * whole once routed, so it leaves now, not an event-loop turn later (that turn sat in every token's
   * latency). Entries pushed outside a step (accepted, errors) wait for the next turn, so that a burst
   * of them shares one write.
   */
  #routeAndFlush(route: () => void): void {
    this.#routing = true;
    try {
      route();
    } finally {
      this.#routing = false;
    }
    this.#flush();
  }

  /** Routes one event; a failure is logged and leaves the other requests of the step unharmed. */
  #routeLogged(route: Route, event: EngineEvent): void {
    try {
      this.#route(route, event);
    } catch (error) {
      this.logger.error({ err: error, requestId: route.requestId }, 'routing an engine event failed');
    }
  }

  /**
   * The checks failed: the request is stopped (`reason`) and nothing the engine made for it is written;
   * its finish still settles the job.
   */
  drop(route: Route, reason: string): void {
    const gate = route.gate;
    route.gate = 'dropping';
    if (route.sink !== undefined) {
      this.#writer?.({ type: 'drop', requestId: route.requestId });
      const finishing = this.#takeBack(route);
      route.abort(reason);
      if (finishing !== undefined) route.onFinish(finishing);
      return;
    }
    route.abort(reason);
    if (gate !== undefined && gate !== 'dropping') for (const event of gate.held) this.#gated(route, 'dropping', event);
  }

  /** The writer no longer has the route: what was pushed meanwhile goes out from here; its finish, if it came, is returned. */
  #takeBack(route: Route): Extract<EngineEvent, { type: 'finish' }> | undefined {
    const { sinkEntries, finishing } = route;
    route.sink = undefined;
    route.sinkEntries = undefined;
    route.finishing = undefined;
    for (const draft of sinkEntries ?? []) this.push(route, draft);
    return finishing;
  }

  /** What the thread writer says: the worker's `engine.sink.onMessage` listener. */
  readonly onWriterReport = (message: unknown): void => {
    const report = message as WriterReport;
    if (report.type === 'unheard') {
      this.#checkGateway(report.channel);
      return;
    }
    if (report.type === 'returned') {
      // Their ends leave in one write.
      this.#routeAndFlush(() => {
        for (const returned of report.requests) this.#returned(returned);
      });
      return;
    }
    const route = this.#routes.get(report.requestId);
    if (route === undefined || route.sink === undefined) return;
    switch (report.type) {
      case 'fenced':
        this.#appended(route, 0);
        return;
      case 'lost':
        this.logger.error({ requestId: route.requestId, why: report.why }, 'writing a step failed');
        this.#lost(route);
        return;
      case 'log-behind':
        this.logger.error({ requestId: route.requestId, why: report.why }, 'appending to the token log failed');
        route.logBehind = true;
        return;
    }
  };

  #gated(route: Route, gate: NonNullable<Route['gate']>, event: EngineEvent): void {
    if (gate === 'dropping') {
      if (event.type === 'finish') route.onFinish(event);
      return;
    }
    gate.held.push(event);
    // The TTFT breakdown's "step on the worker host" is when the step got here, not when it is released.
    if (event.type === 'text-delta' && event.text !== '' && route.timing !== undefined) route.timing.firstStepAt ??= epochMs();
  }

  /**
   * The request is about to be handed to another worker (a drain, a Redis outage): nothing more the
   * engine makes for it is written here — the continuation carries the stream on from its log. (Before
   * the engine hears of the abort: what it ends with `abort` is not written either.)
   */
  handOver(route: Route): void {
    route.handingOver = true;
    if (route.sink !== undefined) this.#writer?.({ type: 'stop', requestId: route.requestId });
  }

  /** The writer gave the request back: the host writes from `nextSeq` on, its end first. */
  #returned({ requestId, nextSeq, lastFinishReason, firstStepAt, publishedAt }: ReturnedRequest): void {
    const route = this.#routes.get(requestId);
    if (route === undefined || route.sink === undefined) return;
    route.nextSeq = nextSeq;
    if (lastFinishReason !== undefined) route.lastFinishReason = lastFinishReason;
    if (route.timing !== undefined) {
      if (firstStepAt !== undefined) route.timing.firstStepAt ??= firstStepAt;
      if (publishedAt !== undefined) route.timing.publishedAt ??= publishedAt;
    }
    const finishing = this.#takeBack(route);
    if (finishing !== undefined) route.onFinish(finishing);
  }

  /**
   * Numbers an entry and queues it for this step's write (none for a request whose entries were lost);
   * while the thread writer has the request, it waits for the writer (which numbers what it writes).
   */
  push(route: Route, draft: EntryDraft): void {
    if (route.lost === true) return;
    if (route.sink !== undefined) {
      (route.sinkEntries ??= []).push(draft);
      return;
    }
    this.#batch.add(route, route.channel, route.nextSeq++, draft);
    // Inside a step the step flushes at its end: no turn is set (it would only find nothing to flush).
    if (!this.#routing && !this.#turnFlush) {
      this.#turnFlush = true;
      setImmediate(() => {
        this.#turnFlush = false;
        this.#flush();
      });
    }
  }

  /** Live entries go to `channel` from now on (a client resumed there). */
  attach(requestId: string, channel: string): void {
    const route = this.#routes.get(requestId);
    if (route === undefined) return;
    route.moved = true;
    clearTimeout(route.graceTimer);
    route.graceTimer = undefined;
    this.#setChannel(route, channel);
  }

  #setChannel(route: Route, channel: string | null): void {
    route.channel = channel;
    if (route.sink !== undefined) this.#writer?.({ type: 'route', requestId: route.requestId, channel });
  }

  /**
   * The client of `from` left (or `from` died): stop publishing live and cancel the request once its
   * grace, counted from `detachedAt`, runs out — unless a client attaches first.
   */
  detach(requestId: string, from: string | null, detachedAt = Date.now()): void {
    const route = this.#routes.get(requestId);
    if (route === undefined || route.ended) return;
    if (from !== null && route.channel !== from) return;
    route.moved = true;
    this.#setChannel(route, null);
    clearTimeout(route.graceTimer);
    const left = route.graceMs - (Date.now() - detachedAt);
    if (left <= 0) {
      route.abort('client_closed');
      return;
    }
    route.graceTimer = setTimeout(() => {
      if (route.channel === null) route.abort('client_closed');
    }, left);
    route.graceTimer.unref();
  }

  /**
   * Reads the routes of running requests (`requestIds`, else all) again from their metas, the
   * authority, and applies them (a detach starts its grace from when it happened): after the control
   * subscriber was away (route messages sent meanwhile never came), and for every route message, which
   * says only that a route changed — two gateways' messages can arrive in either order.
   */
  async resyncRoutes(requestIds?: readonly string[]): Promise<void> {
    const all = requestIds === undefined ? [...new Set(this.#routes.values())] : requestIds.map((id) => this.#routes.get(id));
    const routes = all.filter((route): route is Route => route !== undefined && !route.ended);
    if (routes.length === 0) return;
    const reads = this.#redis.pipeline();
    for (const route of routes) reads.hmget(this.options.names.metaKey(route.requestId), 'channel', 'detachedAt');
    const replies = (await reads.exec()) ?? [];
    routes.forEach((route, i) => {
      const [error, fields] = replies[i] ?? [];
      if (error !== null && error !== undefined) return;
      const [channel, detachedAt] = fields as [string | null, string | null];
      // No meta (expired): nothing to go by.
      if (channel === null) return;
      if (channel === '') {
        if (route.channel !== null) this.detach(route.requestId, null, Number(detachedAt) || Date.now());
      } else if (channel !== route.channel) {
        this.attach(route.requestId, channel);
      }
    });
  }

  /**
   * Resolves true once Redis answers a PING on this connection, false after `timeoutMs`. Its status
   * alone is not enough: just after an outage a connection may still say `ready` before it has noticed
   * its socket is gone, and a command written then waits for a resend that may never come.
   */
  async whenAnswering(timeoutMs: number): Promise<boolean> {
    const until = Date.now() + timeoutMs;
    while (Date.now() < until) {
      if (this.#redis.status === 'ready') {
        const answer = await Promise.race([this.#redis.ping().catch(() => undefined), sleep(PING_WAIT_MS)]);
        if (answer === 'PONG') return true;
      }
      await sleep(PING_RETRY_MS);
    }
    return false;
  }

  /** Resolves when everything pushed so far has been handed to Redis. */
  async drained(): Promise<void> {
    if (this.#turnFlush) await new Promise<void>((resolve) => setImmediate(resolve));
    await this.#flushing;
  }

  #route(route: Route, event: EngineEvent): void {
    if (route.handingOver === true && event.type !== 'finish') return;
    if (event.type === 'finish') {
      route.onFinish(event);
      return;
    }
    for (const draft of eventEntries(route, event)) {
      if (draft.type === 'text-delta' && draft.text !== '' && route.timing !== undefined) route.timing.firstStepAt ??= epochMs();
      this.push(route, draft);
    }
  }

  #flush(): void {
    if (this.#batch.empty) return;
    if (this.#redis.status !== 'ready') {
      // The connection queues nothing while Redis is away: nothing of this step can be written.
      this.logger.error({ status: this.#redis.status }, 'publishing a step failed: Redis unavailable');
      const routes = [...this.#batch.targets()];
      this.#batch.clear();
      for (const route of routes) this.#lost(route);
      return;
    }
    const { retentionMs, maxLogEntries, workerId } = this.options;
    const now = Date.now();
    const firsts: RouteTiming[] = [];
    for (const { timing } of this.#batch.targets())
      if (timing?.firstStepAt !== undefined && timing.publishedAt === undefined) firsts.push(timing);
    // The whole step in one command (one socket write): its appends, then a publish per gateway.
    const { targets, channels, written } = this.#batch.write(this.#scripts, {
      workerId,
      maxEntries: maxLogEntries,
      // The TTL starts when the request ends; until then it only bounds a request nobody finishes.
      ttlMs: (route, final) => (route.ended || final ? retentionMs : Math.max(0, route.deadlineAt - now) + retentionMs),
    });
    this.#flushing = written.then(
      ({ appended, receivers }) => {
        targets.forEach((route, i) => {
          const reply = appended[i]!;
          if (reply instanceof Error) this.#appendFailed(route, reply);
          else this.#appended(route, reply);
        });
        channels.forEach((channel, i) => {
          if (receivers[i] === 0) this.#checkGateway(channel);
        });
        const at = epochMs();
        for (const timing of firsts) timing.publishedAt = at;
      },
      (error: unknown) => {
        // The connection failed under the write (or the script did): which entries reached the logs is unknown.
        this.logger.error({ err: error }, 'writing a step failed');
        for (const route of targets) this.#lost(route);
      },
    );
  }

  /** Redis's answer to an append: 1, or 0 when a newer attempt owns the request (this worker was taken for dead). */
  #appended(route: Route, appended: number): void {
    if (appended !== 0 || route.ended) return;
    this.logger.warn({ requestId: route.requestId, attempt: route.attempt }, 'fenced out by a newer attempt');
    route.channel = null;
    route.abort('superseded');
  }

  /**
   * Redis refused a write of the append (out of memory, ...), on a sound connection: the live stream goes
   * on (its publish went out) and a later resume may find the gap.
   */
  #appendFailed(route: Route, error: Error): void {
    this.logger.error({ err: error, requestId: route.requestId }, 'appending to the token log failed');
    // (An append resent after a reconnect that Redis had made before finds its entry there already.)
    if (!error.message.includes('equal or smaller than the target stream top item')) route.logBehind = true;
  }

  /**
   * This request's entries could not be appended (Redis away, the connection closing under the write):
   * whether they are in its log is unknown, and a later append that succeeds would leave a gap in it.
   * Nothing more is written for it here: it stops now, and once Redis answers the processor hands it
   * over so that a continuation goes on from what its log holds (or, that failing, ends its stream).
   */
  #lost(route: Route): void {
    if (route.ended || route.lost === true) return;
    route.lost = true;
    route.abort(REDIS_UNAVAILABLE);
  }

  /**
   * A publish reached nobody: the gateway may be reconnecting its subscriber (its alive key is there:
   * the log repairs the gap) or dead (its key expired: its clients count as gone).
   */
  #checkGateway(channel: string): void {
    if (this.#checking.has(channel)) return;
    this.#checking.add(channel);
    this.#redis
      .exists(this.options.names.gatewayAliveKey(channel))
      .then((alive) => {
        if (alive === 1) return;
        this.logger.warn({ channel }, 'gateway gone: detaching its requests');
        for (const route of [...this.#routes.values()]) if (route.channel === channel) this.detach(route.requestId, channel);
      })
      .catch((error: unknown) => this.logger.warn({ err: error, channel }, 'checking a gateway failed'))
      .finally(() => this.#checking.delete(channel));
  }
}

function epochMs(): number {
  return performance.timeOrigin + performance.now();
}
