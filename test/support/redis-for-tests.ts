/** A private redis-server for the tests of one file (vitest hooks: not for benches). */
import type { Redis } from 'ioredis';
import { afterAll, beforeAll } from 'vitest';
import { startRedis, type RedisServer } from './redis-server.js';

/**
 * Inside a test file or `describe`: a private redis-server and one client on it, started before its
 * tests and stopped after them. The fields are set once `beforeAll` ran.
 */
export function redisForTests(): { server: RedisServer; redis: Redis } {
  const shared = {} as { server: RedisServer; redis: Redis };
  beforeAll(async () => {
    shared.server = await startRedis();
    shared.redis = shared.server.client();
  });
  afterAll(async () => {
    shared.redis?.disconnect();
    await shared.server?.stop();
  });
  return shared;
}
