import type { Redis } from 'ioredis';
import { decodeLogRange, decodeRequestMeta, logEntryId, type GatewayEntry, type RedisNames, type RequestMeta } from '@sluice/protocol';

export interface LogRead {
  /** Entries from the asked sequence number on, in order. */
  entries: GatewayEntry[];
  /** The request's meta exists: false when the request is unknown, expired, or Redis lost its data. */
  known: boolean;
}

/** Reads a request's token log (see packages/protocol token-log.ts) and meta: gap repair and resume. */
export interface TokenLog {
  /** Entries from `fromSeq` on, up to `toSeq` (inclusive) when given. */
  read(requestId: string, fromSeq: number, toSeq?: number): Promise<LogRead>;
  /** The request's meta; undefined when unknown or expired. */
  meta(requestId: string): Promise<RequestMeta | undefined>;
  /** The log's last entry (undefined when it has none yet). */
  last(requestId: string): Promise<GatewayEntry | undefined>;
  /** The log's last `count` entries, in log order. */
  tail(requestId: string, count: number): Promise<GatewayEntry[]>;
}

export class RedisTokenLog implements TokenLog {
  constructor(
    private readonly redis: Redis,
    private readonly names: RedisNames,
  ) {}

  async read(requestId: string, fromSeq: number, toSeq?: number): Promise<LogRead> {
    const replies = await this.redis
      .multi()
      .xrange(this.names.logKey(requestId), logEntryId(fromSeq), toSeq === undefined ? '+' : logEntryId(toSeq))
      .exists(this.names.metaKey(requestId))
      .exec();
    const [[rangeError, range], [, exists]] = (replies ?? []) as [[Error | null, Array<[string, string[]]>], [Error | null, number]];
    if (rangeError) throw rangeError;
    const entries = decodeLogRange(range);
    return { entries, known: exists === 1 };
  }

  async meta(requestId: string): Promise<RequestMeta | undefined> {
    return decodeRequestMeta(await this.redis.hgetall(this.names.metaKey(requestId)));
  }

  async tail(requestId: string, count: number): Promise<GatewayEntry[]> {
    return decodeLogRange(await this.redis.xrevrange(this.names.logKey(requestId), '+', '-', 'COUNT', count)).reverse();
  }

  async last(requestId: string): Promise<GatewayEntry | undefined> {
    return decodeLogRange(await this.redis.xrevrange(this.names.logKey(requestId), '+', '-', 'COUNT', 1))[0];
  }
}
