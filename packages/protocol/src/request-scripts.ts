import type { ChainableCommander, Redis } from 'ioredis';
import type { RedisNames } from './names.js';
import {
  APPEND_LOG_SCRIPT,
  CANCEL_IF_ROUTED_SCRIPT,
  CREATE_META_SCRIPT,
  MIGRATE_SCRIPT,
  RECORD_USAGE_SCRIPT,
  ROUTE_SCRIPT,
} from './token-log.js';

/** One append to a request's token log ({@link APPEND_LOG_SCRIPT}). */
export interface LogAppend {
  requestId: string;
  /** The writer's attempt: an append of any other than the meta's is fenced out. */
  attempt: number;
  /** Approximate cap on the log's entries (XADD MAXLEN ~). */
  maxEntries: number;
  /** The log's (and meta's) TTL from now. */
  ttlMs: number;
  /** Written as the meta's worker ('' leaves it). */
  workerId: string;
  /** seq, json, seq, json, ... */
  pairs: readonly string[];
}

/** The outcome of {@link MIGRATE_SCRIPT}: `[code, attempt]` as the script documents it. */
export type MigrateReply = [code: number, attempt: number];

/** On a pipeline, a command queues and returns the pipeline. */
interface QueuedCommands {
  appendLog(meta: string, log: string, ...args: Array<string | number>): ChainableCommander;
  cancelIfRouted(meta: string, marker: string, channel: string, reason: string, ttlMs: number): ChainableCommander;
}

interface ScriptCommands {
  createMeta(meta: string, ttlMs: number, ...pairs: string[]): Promise<number>;
  appendLog(meta: string, log: string, ...args: Array<string | number>): Promise<number>;
  routeRequest(meta: string, channel: string, from: string, now: number): Promise<number>;
  migrateRequest(meta: string, ...args: Array<string | number>): Promise<MigrateReply>;
  recordUsage(meta: string, promptTokens: number, completionTokens: number): Promise<[number, number]>;
}

/**
 * The token log's Lua scripts as typed calls, for every process that writes a request's log or route
 * (workers append and hand over; gateways append a cancel's entries, move routes and migrate): one
 * place that defines them on a connection and spells their arguments.
 */
export class RequestScripts {
  readonly #redis: Redis & ScriptCommands;

  constructor(
    redis: Redis,
    private readonly names: RedisNames,
  ) {
    // ioredis sends EVALSHA, and EVAL once when Redis does not know the script yet.
    redis.defineCommand('createMeta', { numberOfKeys: 1, lua: CREATE_META_SCRIPT });
    redis.defineCommand('appendLog', { numberOfKeys: 2, lua: APPEND_LOG_SCRIPT });
    redis.defineCommand('routeRequest', { numberOfKeys: 1, lua: ROUTE_SCRIPT });
    redis.defineCommand('migrateRequest', { numberOfKeys: 1, lua: MIGRATE_SCRIPT });
    redis.defineCommand('recordUsage', { numberOfKeys: 1, lua: RECORD_USAGE_SCRIPT });
    redis.defineCommand('cancelIfRouted', { numberOfKeys: 2, lua: CANCEL_IF_ROUTED_SCRIPT });
    this.#redis = redis as Redis & ScriptCommands;
  }

  /** Writes a new request's meta (the fields of `encodeRequestMeta`) with its TTL, in one command. */
  createMeta(requestId: string, fields: Record<string, string>, ttlMs: number): Promise<number> {
    const pairs: string[] = [];
    for (const [field, value] of Object.entries(fields)) pairs.push(field, value);
    return this.#redis.createMeta(this.names.metaKey(requestId), ttlMs, ...pairs);
  }

  /** Queues an append on a pipeline (or MULTI) of the same connection; its reply is 1, or 0 when fenced out. */
  appendLog(pipeline: ChainableCommander, append: LogAppend): void {
    (pipeline as ChainableCommander & QueuedCommands).appendLog(...this.#appendArgs(append));
  }

  /**
   * Queues a waiting job's cancel marker ({@link CANCEL_IF_ROUTED_SCRIPT}) on a pipeline (or MULTI) of
   * the same connection, set only while the request routes to `channel`; its reply is 1 when set.
   */
  cancelIfRouted(pipeline: ChainableCommander, requestId: string, channel: string, reason: string, ttlMs: number): void {
    (pipeline as ChainableCommander & QueuedCommands).cancelIfRouted(
      this.names.metaKey(requestId),
      this.names.cancelMarkerKey(requestId),
      channel,
      reason,
      ttlMs,
    );
  }

  /** Sends an append on the connection itself; resolves 1, or 0 when fenced out. */
  append(append: LogAppend): Promise<number> {
    return this.#redis.appendLog(...this.#appendArgs(append));
  }

  #appendArgs({ requestId, attempt, maxEntries, ttlMs, workerId, pairs }: LogAppend): [string, string, ...Array<string | number>] {
    return [this.names.metaKey(requestId), this.names.logKey(requestId), attempt, maxEntries, ttlMs, workerId, ...pairs];
  }

  /**
   * Moves the request's live route ({@link ROUTE_SCRIPT}): to `channel` ('' detaches), only while it is
   * `from` ('' = whatever it is). Resolves 1 when moved, 0 when the meta is gone or the route had moved.
   */
  route(requestId: string, channel: string, from: string, now = Date.now()): Promise<number> {
    return this.#redis.routeRequest(this.names.metaKey(requestId), channel, from, now);
  }

  /**
   * Moves the request to a new attempt ({@link MIGRATE_SCRIPT}), fencing out `attempt`, the one of
   * worker `from`; at most `bound` attempts; live entries go to `channel` ('' keeps it detached), as
   * `mover` may route them (see the script). `announce` is published in the same step when it moves.
   */
  migrate(
    requestId: string,
    attempt: number,
    from: string,
    bound: number,
    channel: string,
    mover: 'gateway' | 'worker',
    now = Date.now(),
    announce?: { channel: string; message: string },
  ): Promise<MigrateReply> {
    const published = announce === undefined ? [] : [announce.channel, announce.message];
    return this.#redis.migrateRequest(this.names.metaKey(requestId), attempt, from, bound, channel, now, mover, ...published);
  }

  /**
   * Records a delivery's usage totals in the request's meta ({@link RECORD_USAGE_SCRIPT}); resolves the
   * tokens no earlier delivery recorded.
   */
  async recordUsage(
    requestId: string,
    promptTokens: number,
    completionTokens: number,
  ): Promise<{ promptTokens: number; completionTokens: number }> {
    const [prompt, completion] = await this.#redis.recordUsage(this.names.metaKey(requestId), promptTokens, completionTokens);
    return { promptTokens: prompt, completionTokens: completion };
  }
}
