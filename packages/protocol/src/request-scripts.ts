import { ReplyError as IoredisReplyError, type ChainableCommander, type Redis } from 'ioredis';
import type { RedisNames } from './names.js';
import {
  CANCEL_IF_ROUTED_SCRIPT,
  CREATE_META_SCRIPT,
  MIGRATE_SCRIPT,
  RECORD_USAGE_SCRIPT,
  ROUTE_SCRIPT,
  WRITE_ENTRIES_SCRIPT,
} from './token-log.js';

/** Redis's error reply (ioredis types it `any`). */
const ReplyError = IoredisReplyError as new (message: string) => Error;

/** One append to a request's token log ({@link WRITE_ENTRIES_SCRIPT}). */
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

/** One publish of {@link RequestScripts.writeEntries}: a channel and its message. */
export interface Publish {
  channel: string;
  message: string;
}

/** What {@link RequestScripts.writeEntries} did, in the order of its appends and publishes. */
export interface EntriesWritten {
  /** Per append: 1 appended, 0 fenced out (another attempt owns the request), or the error that stopped it. */
  appended: Array<1 | 0 | Error>;
  /** Per publish: how many subscribers received it. */
  receivers: number[];
}

/** The outcome of {@link MIGRATE_SCRIPT}: `[code, attempt]` as the script documents it. */
export type MigrateReply = [code: number, attempt: number];

/** On a pipeline, a command queues and returns the pipeline. */
interface QueuedCommands {
  cancelIfRouted(meta: string, marker: string, channel: string, reason: string, ttlMs: number): ChainableCommander;
}

interface ScriptCommands {
  createMeta(meta: string, ttlMs: number, ...pairs: string[]): Promise<number>;
  writeEntries(keyCount: number, ...keysAndArgs: Array<string | number>): Promise<Array<number | string | number[]>>;
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
    redis.defineCommand('writeEntries', { lua: WRITE_ENTRIES_SCRIPT });
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

  /**
   * Appends to the logs of `appends`' requests, then publishes `publishes`, in one command
   * ({@link WRITE_ENTRIES_SCRIPT}). Rejects only when the command as a whole failed (the connection,
   * or a script error): then which of its writes were made is unknown.
   */
  async writeEntries(appends: readonly LogAppend[], publishes: readonly Publish[] = []): Promise<EntriesWritten> {
    const keys: string[] = [];
    const args: Array<string | number> = [appends.length];
    for (const { requestId, attempt, maxEntries, ttlMs, workerId, pairs } of appends) {
      keys.push(this.names.metaKey(requestId), this.names.logKey(requestId));
      args.push(attempt, maxEntries, ttlMs, workerId, pairs.length / 2);
      for (const value of pairs) args.push(value);
    }
    for (const { channel, message } of publishes) args.push(channel, message);
    const replies = await this.#redis.writeEntries(keys.length, ...keys, ...args);
    return {
      appended: appends.map((_, i) => {
        const reply = replies[i];
        return reply === 1 || reply === 0 ? reply : new ReplyError(String(reply));
      }),
      receivers: replies[appends.length] as number[],
    };
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
