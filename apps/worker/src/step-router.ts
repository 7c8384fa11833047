import { setTimeout as sleep } from 'node:timers/promises';
import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import type { EngineEvent, StepEvent, TokenLogprob } from '@sluice/engine';
import {
  encodeEntry,
  endsRequest,
  liveGatewayMessage,
  RequestScripts,
  type GatewayEntryDraft,
  type LogAppend,
  type Publish,
  type RedisNames,
  type TokenLogprobWire,
} from '@sluice/protocol';

/** The abort reason of a request whose entries could not be written (Redis unreachable). */
export const REDIS_UNAVAILABLE = 'redis_unavailable';

/** How long a PING may take to say Redis answers again, and how long to wait before the next try. */
const PING_WAIT_MS = 500;
const PING_RETRY_MS = 100;

/** An entry before the router numbers it and names its request. */
export type EntryDraft = GatewayEntryDraft extends infer E ? (E extends GatewayEntryDraft ? Omit<E, 'requestId'> : never) : never;

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

interface PendingAppend {
  route: Route;
  /** seq, json, seq, json, ... (the script's argument tail). */
  pairs: string[];
  workerId: string;
  /** The request's last entry is among them (finish, error, rejected): its log's TTL is the retention. */
  final: boolean;
}

/**
 * Routes every engine step as a whole, in one pass: each event becomes a numbered wire entry, serialized
 * once (`encodeEntry`: the whole entry for its request's token log, the live form without token ids for
 * its gateway's message); then ONE command carries the step (`RequestScripts.writeEntries`, a Lua
 * script): an append per request, fenced by attempt, then one PUBLISH per gateway channel. Appends come
 * first, so an entry a gateway sees live is always in the log already.
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
  #logs = new Map<Route, PendingAppend>();
  #channels = new Map<string, string[]>();
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
  ) {
    this.#redis = redis;
    this.#scripts = new RequestScripts(redis, options.names);
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
        if (route.gate !== undefined) this.#gated(route, route.gate, event);
        else this.#routeLogged(route, event);
      }
    });

  /** The route's engine events wait until {@link release} or {@link drop}: its job's checks are still out. */
  hold(route: Route): void {
    route.gate = { held: [] };
  }

  /**
   * The checks passed: the events held meanwhile are routed now, after what the caller pushed (its
   * `accepted`), and leave in one write at once.
   */
  release(route: Route): void {
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
    route.abort(reason);
    if (gate !== undefined && gate !== 'dropping') for (const event of gate.held) this.#gated(route, 'dropping', event);
  }

  #gated(route: Route, gate: NonNullable<Route['gate']>, event: EngineEvent): void {
    if (gate === 'dropping') {
      if (event.type === 'finish') route.onFinish(event);
      return;
    }
    gate.held.push(event);
    // The TTFT breakdown's "step on the worker host" is when the step got here, not when it is released.
    if (event.type === 'text-delta' && event.text !== '' && route.timing !== undefined) route.timing.firstStepAt ??= epochMs();
  }

  /** Numbers an entry and queues it for this step's write (none for a request whose entries were lost). */
  push(route: Route, draft: EntryDraft): void {
    if (route.lost === true) return;
    const seq = route.nextSeq++;
    const entry = { ...draft, requestId: route.requestId, seq, ...(route.attempt > 1 ? { attempt: route.attempt } : {}) };
    const { logged, live } = encodeEntry(entry);
    const log = this.#logs.get(route);
    if (log === undefined) {
      this.#logs.set(route, {
        route,
        pairs: [String(seq), logged],
        workerId: draft.type === 'accepted' ? draft.workerId : '',
        final: endsRequest(draft),
      });
    } else {
      log.pairs.push(String(seq), logged);
      if (draft.type === 'accepted') log.workerId = draft.workerId;
      if (endsRequest(draft)) log.final = true;
    }
    if (route.channel !== null) {
      const entries = this.#channels.get(route.channel);
      if (entries === undefined) this.#channels.set(route.channel, [live]);
      else entries.push(live);
    }
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
    route.channel = channel;
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
    route.channel = null;
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
    switch (event.type) {
      case 'text-delta': {
        const held = route.held[event.index];
        const tokens = event.tokenIds.length + (held?.tokens ?? 0);
        const tokenIds = held === undefined ? event.tokenIds : [...held.ids, ...event.tokenIds];
        if (event.text === '' && event.logprobs === undefined) {
          // Text held back (an incomplete UTF-8 sequence): the tokens ride on the choice's next delta.
          route.held[event.index] = { tokens, ids: tokenIds };
          return;
        }
        route.held[event.index] = undefined;
        if (route.timing !== undefined && route.timing.firstStepAt === undefined) route.timing.firstStepAt = epochMs();
        this.push(route, {
          type: 'text-delta',
          index: event.index,
          text: event.text,
          tokens,
          tokenIds,
          ...(event.logprobs === undefined ? {} : { logprobs: event.logprobs.map(toWireLogprob) }),
        });
        return;
      }
      case 'text-end': {
        // Tokens whose text never showed (held back to the end): an empty delta carries them.
        const held = route.held[event.index];
        if (held !== undefined)
          this.push(route, { type: 'text-delta', index: event.index, text: '', tokens: held.tokens, tokenIds: held.ids });
        route.held[event.index] = undefined;
        if (event.finishReason === 'stop' || event.finishReason === 'length') route.lastFinishReason = event.finishReason;
        if (event.finishReason !== 'error') this.push(route, { type: 'text-end', index: event.index, finishReason: event.finishReason });
        return;
      }
      case 'scheduled':
        this.push(route, { type: 'scheduled' });
        return;
      case 'finish':
        route.onFinish(event);
        return;
    }
  }

  #flush(): void {
    const logs = this.#logs;
    const channels = this.#channels;
    if (logs.size === 0 && channels.size === 0) return;
    this.#logs = new Map();
    this.#channels = new Map();
    if (this.#redis.status !== 'ready') {
      // The connection queues nothing while Redis is away: nothing of this step can be written.
      this.logger.error({ status: this.#redis.status }, 'publishing a step failed: Redis unavailable');
      for (const { route } of logs.values()) this.#lost(route);
      return;
    }
    const { retentionMs, maxLogEntries, workerId } = this.options;
    const now = Date.now();
    const routes: Route[] = [];
    const appends: LogAppend[] = [];
    let firsts: RouteTiming[] | undefined;
    for (const { route, pairs, workerId: accepting, final } of logs.values()) {
      if (route.timing?.firstStepAt !== undefined && route.timing.publishedAt === undefined) (firsts ??= []).push(route.timing);
      // The TTL starts when the request ends; until then it only bounds a request nobody finishes.
      const ttlMs = route.ended || final ? retentionMs : Math.max(0, route.deadlineAt - now) + retentionMs;
      routes.push(route);
      appends.push({ requestId: route.requestId, attempt: route.attempt, maxEntries: maxLogEntries, ttlMs, workerId: accepting, pairs });
    }
    const publishes: Publish[] = [];
    for (const [channel, entries] of channels) publishes.push({ channel, message: liveGatewayMessage(workerId, entries) });
    // The whole step in one command (one socket write): its appends, then a publish per gateway.
    this.#flushing = this.#scripts.writeEntries(appends, publishes).then(
      ({ appended, receivers }) => {
        routes.forEach((route, i) => {
          const reply = appended[i]!;
          if (reply instanceof Error) this.#appendFailed(route, reply);
          else this.#appended(route, reply);
        });
        publishes.forEach(({ channel }, i) => {
          if (receivers[i] === 0) this.#checkGateway(channel);
        });
        if (firsts === undefined) return;
        const at = epochMs();
        for (const timing of firsts) timing.publishedAt = at;
      },
      (error: unknown) => {
        // The connection failed under the write (or the script did): which entries reached the logs is unknown.
        this.logger.error({ err: error }, 'writing a step failed');
        for (const route of routes) this.#lost(route);
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

function toWireLogprob(lp: TokenLogprob): TokenLogprobWire {
  const out: TokenLogprobWire = { token: lp.token, logprob: lp.logprob };
  if (lp.bytes !== undefined) out.bytes = lp.bytes;
  if (lp.topLogprobs !== undefined) {
    out.top = lp.topLogprobs.map((t) =>
      t.bytes === undefined ? { token: t.token, logprob: t.logprob } : { token: t.token, logprob: t.logprob, bytes: t.bytes },
    );
  }
  return out;
}
