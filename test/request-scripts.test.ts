import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startRedis, type RedisServer } from './support/redis-server.js';
import { decodeRequestMeta, encodeRequestMeta, redisNames, RequestScripts } from '@sluice/protocol';

let server: RedisServer;
let redis: Redis;

beforeAll(async () => {
  server = await startRedis();
  redis = new Redis(server.url);
});

afterAll(async () => {
  await redis.quit();
  await server.stop();
});

describe('request scripts on a real Redis', () => {
  it("creates a request's meta with every field and its TTL in one command", async () => {
    const names = redisNames('t');
    const scripts = new RequestScripts(redis, names);
    const format = {
      endpoint: 'completion' as const,
      model: 'm',
      created: 7,
      includeUsage: false,
      n: 1,
      maxTokensParam: 'max_tokens' as const,
    };
    const meta = { channel: 'gw-1', graceMs: 500, attempt: 1, enqueuedAt: 11, deadlineAt: 22, format, owner: 'k1' };

    await expect(scripts.createMeta('r1', encodeRequestMeta(meta), 60_000)).resolves.toBe(1);

    expect(decodeRequestMeta(await redis.hgetall(names.metaKey('r1')))).toEqual(meta);
    const ttl = await redis.pttl(names.metaKey('r1'));
    expect(ttl).toBeGreaterThan(50_000);
    expect(ttl).toBeLessThanOrEqual(60_000);
  });
});
