import { createHash } from 'node:crypto';
import type { Redis } from 'ioredis';
import type { ApiKeyLimits } from './api-key.js';

/**
 * Per-key limits, exact across any number of gateways: every decision is one Lua script run in Redis
 * (atomic, on Redis's clock), so two gateways can never both take the last unit.
 *
 * Why a script and not `rate-limiter-flexible`: its RateLimiterRedis is atomic per limiter, but a
 * request here must pass three limits at once (requests, tokens, streams) and take from all or none;
 * with three limiters, a request refused by the second has already consumed from the first, and the
 * refund races other requests (40 concurrent requests on a 10 RPM key could admit fewer than 10).
 * Its windows are fixed windows that start at the first consume, so a refund after the window rolled
 * over lands in the wrong window, and it has no counting semaphore for concurrent streams. The script
 * below is ~60 lines and does exactly what the limits promise:
 *
 * - requests: a sliding log (sorted set of admission times): never more than `rpm` in any 60 s.
 * - tokens: a sliding log of reservations (request id → tokens, plus their running total): a request
 *   reserves its worst case (prompt bound + max_tokens × n) and is refused when the window's total
 *   would exceed `tpm`; when it ends, its entry is settled to the real usage (the total shrinks), so
 *   concurrent requests can never overshoot and the window counts what was really used. The
 *   reservation has an owner too (request id → token, as the slot's): only the delivery that owns it
 *   settles it, so an older delivery that ends after a resume took the stream over (the old connection
 *   closing late, having written a few tokens) cannot settle it below what the generation uses.
 * - streams: a sorted set of request ids scored by a lease expiry, removed when the request ends (a
 *   gateway that dies mid-stream leaks its slots only until the lease, the request deadline, passes).
 *   Each slot has an owner (a hash beside it, request id → token): the delivery that holds it — the
 *   admission's, then each resume's, which claims it with a fresh token. Only the owner moves or
 *   frees the slot, so an older delivery that ends late (the connection a resume took over, or one
 *   on another gateway that closes after the resume) can never shorten or free what a resume holds.
 */

const WINDOW_MS = 60_000;

/** Lua: extends a key's expiry to at least `ms` from now (never shortens what a longer hold set). */
const KEEP = `
local function keep(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end`;

const ADMIT = `${KEEP}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, maxStreams = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, id, window, lease, owner = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local refused = ''
local retryMs = 0
local reqCount, total, streams = 0, 0, 0
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  reqCount = redis.call('ZCARD', KEYS[1])
  if reqCount >= rpm then
    refused = 'requests'
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    retryMs = tonumber(oldest[2]) + window - now
  end
end
if tpm > 0 then
  local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - window)
  total = tonumber(redis.call('GET', KEYS[4]) or '0')
  for _, member in ipairs(old) do
    total = total - tonumber(redis.call('HGET', KEYS[3], member) or '0')
    redis.call('HDEL', KEYS[3], member)
    redis.call('HDEL', KEYS[7], member)
  end
  if #old > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
    -- KEEPTTL: the total expires with the window's entries (a plain SET made it outlive them, and a
    -- key kept a phantom total, refused for good, once they expired).
    redis.call('SET', KEYS[4], total, 'KEEPTTL')
  end
  -- No entry in the window, no tokens: heals a total left behind without its entries.
  if total ~= 0 and redis.call('EXISTS', KEYS[2]) == 0 then
    total = 0
    redis.call('DEL', KEYS[4])
  end
  if refused == '' and total + cost > tpm then
    refused = 'tokens'
    -- The earliest time enough reservations leave the window for this one to fit (the gateway
    -- refuses a cost over the whole budget before asking; then the window's end).
    retryMs = window
    local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    local left = total
    for i = 1, #entries, 2 do
      left = left - tonumber(redis.call('HGET', KEYS[3], entries[i]) or '0')
      retryMs = tonumber(entries[i + 1]) + window - now
      if left + cost <= tpm then break end
    end
  end
end
if maxStreams > 0 then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
  for _, member in ipairs(expired) do redis.call('HDEL', KEYS[6], member) end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now) end
  streams = redis.call('ZCARD', KEYS[5])
  if refused == '' and streams >= maxStreams then
    refused = 'streams'
    -- A stream's end is not foreseeable: a short retry.
    retryMs = 1000
  end
end
if refused == '' then
  if rpm > 0 then
    redis.call('ZADD', KEYS[1], now, id)
    reqCount = reqCount + 1
    redis.call('PEXPIRE', KEYS[1], window)
  end
  if tpm > 0 then
    redis.call('ZADD', KEYS[2], now, id)
    redis.call('HSET', KEYS[3], id, cost)
    redis.call('HSET', KEYS[7], id, owner)
    total = total + cost
    redis.call('SET', KEYS[4], total)
    for _, i in ipairs({2, 3, 4, 7}) do redis.call('PEXPIRE', KEYS[i], window + lease) end
  end
  if maxStreams > 0 then
    redis.call('ZADD', KEYS[5], now + lease, id)
    redis.call('HSET', KEYS[6], id, owner)
    streams = streams + 1
    keep(KEYS[5], lease)
    keep(KEYS[6], lease)
  end
end
-- Full reset: when the newest entry leaves the window.
local reqReset, tokReset = 0, 0
if rpm > 0 and reqCount > 0 then
  local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if newest[2] then reqReset = tonumber(newest[2]) + window - now end
end
if tpm > 0 and total > 0 then
  local newest = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  if newest[2] then tokReset = tonumber(newest[2]) + window - now end
end
return {refused, retryMs, reqCount, reqReset, total, tokReset, streams}
`;

/**
 * Lua (with `id`, `owner` and `holdMs` set): stream slot `id`, if `owner` still holds it, held `holdMs`
 * from now on Redis's clock (a detached generation goes on unseen; a resumed stream runs), or freed
 * with its owner entry (0). A delivery that no longer owns the slot (a resume claimed it) changes nothing.
 */
const HOLD_SLOT = `${KEEP}
if redis.call('HGET', KEYS[6], id) == owner then
  if holdMs > 0 then
    local t = redis.call('TIME')
    redis.call('ZADD', KEYS[5], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + holdMs, id)
    keep(KEYS[5], holdMs)
    keep(KEYS[6], holdMs)
  else
    redis.call('ZREM', KEYS[5], id)
    redis.call('HDEL', KEYS[6], id)
  end
end`;

/**
 * Settles a request's token reservation to ARGV[2] used tokens if `owner` owns it (or nobody does: one
 * admitted before owners), then its slot as {@link HOLD_SLOT}.
 */
const SETTLE = `
local id, used, owner, holdMs = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local reserved = redis.call('HGET', KEYS[3], id)
local tokenOwner = redis.call('HGET', KEYS[7], id)
local delta = 0
if reserved and (not tokenOwner or tokenOwner == owner) then
  -- Still in the window: its reservation becomes what it really used.
  delta = used - tonumber(reserved)
  redis.call('HSET', KEYS[3], id, used)
  redis.call('INCRBY', KEYS[4], delta)
end
${HOLD_SLOT}
return delta
`;

/** A resumed delivery's slot: held (or freed) as {@link HOLD_SLOT}. */
const HOLD = `
local id, owner, holdMs = ARGV[1], ARGV[2], tonumber(ARGV[3])
${HOLD_SLOT}
return 1
`;

/**
 * A resume takes request `id`'s token reservation (while it is in the window) and, with ARGV[4] = 1,
 * its slot, whoever held them: owner ARGV[2], the slot held ARGV[3] ms from now. Not counted against
 * max-streams: the request was admitted once, and a resume only moves its delivery.
 */
const CLAIM = `
local id, owner, holdMs = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('HEXISTS', KEYS[3], id) == 1 then redis.call('HSET', KEYS[7], id, owner) end
if ARGV[4] ~= '1' then return 1 end
redis.call('HSET', KEYS[6], id, owner)
${HOLD_SLOT}
return 1
`;

/** Which limit refused a request. */
export type LimitName = 'requests' | 'tokens' | 'streams';

/** The state of a key's limits after one decision: the `x-ratelimit-*` headers. */
export interface LimitState {
  limits: ApiKeyLimits;
  /** Requests admitted in the last 60 s (this one included when admitted). */
  requestsUsed: number;
  /** ms until the request window is empty again. */
  requestsResetMs: number;
  /** Tokens reserved or used in the last 60 s. */
  tokensUsed: number;
  tokensResetMs: number;
  streams: number;
}

export type Admission =
  { admitted: true; state: LimitState } | { admitted: false; refused: LimitName; retryAfterMs: number; state: LimitState };

class Script {
  readonly sha: string;
  constructor(readonly source: string) {
    this.sha = createHash('sha1').update(source).digest('hex');
  }

  /** EVALSHA, loading the script on NOSCRIPT (a restarted or flushed Redis). */
  async run(redis: Redis, keys: string[], args: Array<string | number>): Promise<unknown> {
    try {
      return await redis.evalsha(this.sha, keys.length, ...keys, ...args);
    } catch (error) {
      if (!(error instanceof Error) || !error.message.startsWith('NOSCRIPT')) throw error;
      return redis.eval(this.source, keys.length, ...keys, ...args);
    }
  }
}

const admitScript = new Script(ADMIT);
const settleScript = new Script(SETTLE);
const holdScript = new Script(HOLD);
const claimScript = new Script(CLAIM);

export class RateLimiter {
  readonly #redis: Redis;
  readonly #prefix: string;

  constructor(redis: Redis, prefix: string) {
    this.#redis = redis;
    this.#prefix = prefix;
  }

  /** The Redis keys of one API key's limits; one hash tag, so a Redis Cluster keeps them in one slot. */
  keys(keyHash: string): string[] {
    const base = `${this.#prefix}:ratelimit:{${keyHash}}`;
    return [
      `${base}:requests`,
      `${base}:tokens`,
      `${base}:token-costs`,
      `${base}:token-total`,
      `${base}:streams`,
      `${base}:stream-owners`,
      `${base}:token-owners`,
    ];
  }

  /**
   * Admits one request of `tokens` reserved tokens under `limits`, or says which limit refuses it and
   * when to retry. `leaseMs` bounds how long a stream slot outlives a gateway that died holding it.
   * @param owner the admitted delivery's token: it holds the stream slot until a resume claims it
   */
  async admit(
    keyHash: string,
    limits: ApiKeyLimits,
    requestId: string,
    tokens: number,
    leaseMs: number,
    owner: string,
  ): Promise<Admission> {
    const reply = (await admitScript.run(this.#redis, this.keys(keyHash), [
      limits.rpm ?? 0,
      limits.tpm ?? 0,
      limits.maxStreams ?? 0,
      tokens,
      requestId,
      WINDOW_MS,
      leaseMs,
      owner,
    ])) as [string, number, number, number, number, number, number];
    const [refused, retryMs, requestsUsed, requestsResetMs, tokensUsed, tokensResetMs, streams] = reply;
    const state: LimitState = { limits, requestsUsed, requestsResetMs, tokensUsed, tokensResetMs, streams };
    if (refused === '') return { admitted: true, state };
    return { admitted: false, refused: refused as LimitName, retryAfterMs: Math.max(0, retryMs), state };
  }

  /**
   * The request's delivery by `owner` ended having used `tokens`: settle its reservation and free its
   * stream slot — unless a resume owns the slot by now (then the slot is left as the resume set it) —
   * @param holdMs or, when its client detached (the generation goes on unseen), keep the slot this long
   * @returns how many tokens it used beyond its reservation (negative: a refund)
   */
  async settle(keyHash: string, requestId: string, owner: string, tokens: number, holdMs = 0): Promise<number> {
    return (await settleScript.run(this.#redis, this.keys(keyHash), [requestId, tokens, owner, holdMs])) as number;
  }

  /**
   * A resume takes a request's token reservation and (`slot`) its stream slot with its own `owner`
   * token, the slot held for `holdMs` from now.
   */
  async claim(keyHash: string, requestId: string, owner: string, holdMs: number, slot = true): Promise<void> {
    await claimScript.run(this.#redis, this.keys(keyHash), [requestId, owner, holdMs, slot ? 1 : 0]);
  }

  /** A resumed delivery ended: its slot held for `holdMs` from now, or freed (0), if `owner` still holds it. */
  async hold(keyHash: string, requestId: string, owner: string, holdMs: number): Promise<void> {
    await holdScript.run(this.#redis, this.keys(keyHash), [requestId, owner, holdMs]);
  }

  /** Tokens reserved or used in the current window (tests, `keys list`). */
  async tokensInWindow(keyHash: string): Promise<number> {
    return Number((await this.#redis.get(this.keys(keyHash)[3]!)) ?? 0);
  }
}
