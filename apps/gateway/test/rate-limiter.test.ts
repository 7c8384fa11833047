import type { Redis } from 'ioredis';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { startRedis, type RedisServer } from '../../../test/support/redis-server.js';
import type { ApiKeyLimits } from '../src/auth/api-key.js';
import { RateLimiter } from '../src/auth/rate-limiter.js';

/**
 * The limiter's scripts against a real redis-server: who may move or free a stream slot. A request's
 * slot belongs to one delivery at a time (the admission's, then each resume's); an older delivery
 * that ends late must leave a newer one's slot as it is.
 */

const LEASE_MS = 600_000;
const KEY = 'a'.repeat(64);

describe('RateLimiter stream slots', () => {
  let server: RedisServer;
  let redis: Redis;
  let limiter: RateLimiter;
  let keys: string[];

  beforeAll(async () => {
    server = await startRedis();
    redis = server.client();
    limiter = new RateLimiter(redis, 'rl-test');
    keys = limiter.keys(KEY);
  });

  afterAll(async () => {
    redis?.disconnect();
    await server?.stop();
  });

  beforeEach(async () => {
    await redis.flushall();
  });

  const redisNow = async () => {
    const [seconds, micros] = await redis.time();
    return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
  };
  /** ms until the slot's lease passes (undefined: no slot). */
  const slotLeft = async (requestId: string) => {
    const score = await redis.zscore(keys[4]!, requestId);
    return score === null ? undefined : Number(score) - (await redisNow());
  };
  const owners = () => redis.hgetall(keys[5]!);
  const admit = (requestId: string, owner: string, limits: ApiKeyLimits = { maxStreams: 1 }, tokens = 0) =>
    limiter.admit(KEY, limits, requestId, tokens, LEASE_MS, owner);

  it('records the admitted delivery as its slot’s owner, and frees slot and owner when that delivery ends', async () => {
    expect((await admit('r1', 'first')).admitted).toBe(true);
    expect(await owners()).toEqual({ r1: 'first' });
    expect(await slotLeft('r1')).toBeGreaterThan(LEASE_MS - 5_000);
    expect(await admit('r2', 'second')).toMatchObject({ admitted: false, refused: 'streams' });

    // Its client detached within a grace: the slot is held for it.
    await limiter.settle(KEY, 'r1', 'first', 0, 3_000);
    const held = (await slotLeft('r1'))!;
    expect(held).toBeGreaterThan(2_000);
    expect(held).toBeLessThanOrEqual(3_000);

    await limiter.settle(KEY, 'r1', 'first', 0, 0);
    expect(await slotLeft('r1')).toBeUndefined();
    expect(await owners()).toEqual({});
    expect((await admit('r2', 'second')).admitted).toBe(true);
  });

  it('leaves a resume’s slot as the resume set it when the older delivery holds or releases it afterwards', async () => {
    await admit('r1', 'admitted');
    await limiter.claim(KEY, 'r1', 'resume', 120_000);
    expect(await owners()).toEqual({ r1: 'resume' });

    // The old connection detaches (it used to re-score the slot to its grace, B2)...
    await limiter.settle(KEY, 'r1', 'admitted', 0, 1_000);
    expect(await slotLeft('r1')).toBeGreaterThan(110_000);
    // ...or ends as taken over, or released (it used to free the slot, B1).
    await limiter.settle(KEY, 'r1', 'admitted', 0, 0);
    expect(await slotLeft('r1')).toBeGreaterThan(110_000);
    expect(await owners()).toEqual({ r1: 'resume' });
    expect(await admit('r2', 'other')).toMatchObject({ admitted: false, refused: 'streams' });

    // The resume's own ending frees it.
    await limiter.hold(KEY, 'r1', 'resume', 0);
    expect(await slotLeft('r1')).toBeUndefined();
    expect(await owners()).toEqual({});
    expect((await admit('r2', 'other')).admitted).toBe(true);
  });

  it('gives the slot to the newest resume: an older resume’s ending changes nothing', async () => {
    await admit('r1', 'admitted');
    await limiter.claim(KEY, 'r1', 'resume-1', 120_000);
    await limiter.claim(KEY, 'r1', 'resume-2', 120_000);
    await limiter.hold(KEY, 'r1', 'resume-1', 0);
    await limiter.hold(KEY, 'r1', 'resume-1', 500);
    expect(await slotLeft('r1')).toBeGreaterThan(110_000);
    // The newest resume's client detaches: held for its grace.
    await limiter.hold(KEY, 'r1', 'resume-2', 5_000);
    const held = (await slotLeft('r1'))!;
    expect(held).toBeGreaterThan(4_000);
    expect(held).toBeLessThanOrEqual(5_000);
    // Once freed, a late ending of any delivery does not bring it back.
    await limiter.hold(KEY, 'r1', 'resume-2', 0);
    await limiter.settle(KEY, 'r1', 'admitted', 0, 5_000);
    await limiter.hold(KEY, 'r1', 'resume-1', 5_000);
    expect(await slotLeft('r1')).toBeUndefined();
    expect(await owners()).toEqual({});
  });

  it('leaves the tokens and the slot of a request to the delivery that owns it (a resume), which settles them', async () => {
    await admit('r1', 'admitted', { maxStreams: 1, tpm: 1_000 }, 300);
    expect(await limiter.tokensInWindow(KEY)).toBe(300);
    await limiter.claim(KEY, 'r1', 'resume', 60_000);
    // The delivery the resume took over ends late, having seen 120 tokens: it used to settle them.
    expect(await limiter.settle(KEY, 'r1', 'admitted', 120, 0)).toBe(0);
    expect(await limiter.tokensInWindow(KEY)).toBe(300);
    expect(await slotLeft('r1')).toBeGreaterThan(50_000);
    expect(await limiter.settle(KEY, 'r1', 'resume', 250, 0)).toBe(-50);
    expect(await limiter.tokensInWindow(KEY)).toBe(250);
    expect(await slotLeft('r1')).toBeUndefined();
  });

  it('fences the tokens of a key without --max-streams by their owner too, and settles a reservation made before owners', async () => {
    await limiter.admit(KEY, { tpm: 1_000 }, 'r1', 300, LEASE_MS, 'admitted');
    await limiter.claim(KEY, 'r1', 'resume', 60_000, false);
    expect(await redis.exists(keys[4]!, keys[5]!)).toBe(0);
    expect(await limiter.settle(KEY, 'r1', 'admitted', 120, 0)).toBe(0);
    expect(await limiter.settle(KEY, 'r1', 'resume', 200, 0)).toBe(-100);
    await limiter.admit(KEY, { tpm: 1_000 }, 'r2', 300, LEASE_MS, 'admitted');
    await redis.hdel(keys[6]!, 'r2');
    expect(await limiter.settle(KEY, 'r2', 'anyone', 100, 0)).toBe(-200);
    expect(await limiter.tokensInWindow(KEY)).toBe(300);
  });

  it('does not make a slot for a key without --max-streams when its delivery detaches', async () => {
    await limiter.admit(KEY, { tpm: 1_000 }, 'r1', 100, LEASE_MS, 'admitted');
    await limiter.settle(KEY, 'r1', 'admitted', 100, 5_000);
    expect(await redis.exists(keys[4]!, keys[5]!)).toBe(0);
  });

  it('drops the owner of a slot whose lease passed at the next admission', async () => {
    await limiter.admit(KEY, { maxStreams: 2 }, 'short', 0, 30, 'a');
    await new Promise((resolve) => setTimeout(resolve, 60));
    await admit('r2', 'b', { maxStreams: 2 });
    expect(await owners()).toEqual({ r2: 'b' });
    expect(await redis.zrange(keys[4]!, '0', '-1')).toEqual(['r2']);
  });

  it('keeps both slot keys alive as long as their longest hold', async () => {
    await limiter.admit(KEY, { maxStreams: 2 }, 'r1', 0, 5_000, 'a');
    await limiter.claim(KEY, 'r1', 'b', 60_000);
    // A later admission with a shorter lease does not cut the resume's hold short.
    await limiter.admit(KEY, { maxStreams: 2 }, 'r2', 0, 5_000, 'c');
    for (const key of [keys[4]!, keys[5]!]) expect(await redis.pttl(key)).toBeGreaterThan(50_000);
  });

  it('lets the token total expire with the window it sums, even after a refusal dropped an old entry', async () => {
    const limits = { tpm: 1_000 };
    expect((await limiter.admit(KEY, limits, 'a', 5, LEASE_MS, 'a')).admitted).toBe(true);
    expect((await limiter.admit(KEY, limits, 'b', 600, LEASE_MS, 'b')).admitted).toBe(true);
    // `a` leaves the window (61 s old); a request too big for what is left is refused, and drops it.
    await redis.zadd(keys[1]!, (await redisNow()) - 61_000, 'a');
    expect(await limiter.admit(KEY, limits, 'c', 500, LEASE_MS, 'c')).toMatchObject({ admitted: false, refused: 'tokens' });
    expect(await limiter.tokensInWindow(KEY)).toBe(600);
    // The total keeps the window's expiry (the refusal's SET used to clear it: the total outlived its
    // entries, and the key was refused for good).
    expect(await redis.pttl(keys[3]!)).toBeGreaterThan(60_000);
    // The window's entries expire (as their TTL would): nothing is used any more.
    await redis.del(keys[1]!, keys[2]!);
    expect((await limiter.admit(KEY, limits, 'd', 505, LEASE_MS, 'd')).admitted).toBe(true);
    expect(await limiter.tokensInWindow(KEY)).toBe(505);
  });

  it('heals a token total left behind without its entries (written before the fix)', async () => {
    await redis.set(keys[3]!, '607');
    expect((await limiter.admit(KEY, { tpm: 1_000 }, 'r1', 505, LEASE_MS, 'a')).admitted).toBe(true);
    expect(await limiter.tokensInWindow(KEY)).toBe(505);
  });

  it('loads its scripts again when Redis forgot them (NOSCRIPT)', async () => {
    await admit('r1', 'a');
    await redis.script('FLUSH');
    await limiter.claim(KEY, 'r1', 'b', 60_000);
    await redis.script('FLUSH');
    await limiter.settle(KEY, 'r1', 'a', 0, 0);
    expect(await owners()).toEqual({ r1: 'b' });
    await redis.script('FLUSH');
    await limiter.hold(KEY, 'r1', 'b', 0);
    expect(await slotLeft('r1')).toBeUndefined();
  });
});
