import { Redis } from 'ioredis';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { decodeWorkerRecord, encodeWorkerRecord, redisNames } from '@sluice/protocol';
import { startRedis, type RedisServer } from '../../../test/support/redis-server.js';
import { RegistryHeartbeat } from '../src/registry-heartbeat.js';
import { StartupError } from '../src/startup-error.js';

const names = redisNames('hb');
let server: RedisServer;
let redis: Redis;

beforeAll(async () => {
  server = await startRedis();
  redis = server.client();
});
afterAll(async () => {
  redis?.disconnect();
  await server?.stop();
});

/** Another process's record under `workerId` (as it would write it), with a TTL. */
const foreign = (workerId: string, heartbeatAt: number): string =>
  encodeWorkerRecord({
    workerId,
    modelId: 'm',
    maxContextLength: 64,
    maxBatchSize: 4,
    startedAt: 1,
    heartbeatAt,
    running: 0,
    draining: false,
  });

function heartbeat(workerId: string, errors: string[] = []) {
  const logger = pino({ level: 'warn' }, { write: (line: string) => void errors.push((JSON.parse(line) as { msg: string }).msg) });
  return new RegistryHeartbeat(
    redis,
    names,
    1_000,
    50,
    () => ({ workerId, modelId: 'm', maxContextLength: 64, maxBatchSize: 4, running: 0, draining: false }),
    logger,
  );
}

describe('a worker’s registry record under its id', () => {
  it('waits for a dead process’s record under the same id to go before it registers', async () => {
    const dead = foreign('restarted', Date.now());
    await redis.set(names.workerKey('restarted'), dead, 'PX', 10_000);
    const beats = heartbeat('restarted');
    let registered = false;
    const starting = beats.start().then(() => (registered = true));
    await new Promise((resolve) => setTimeout(resolve, 300));
    expect(registered).toBe(false);
    expect(await redis.get(names.workerKey('restarted'))).toBe(dead);
    // It expires (here: goes now).
    await redis.del(names.workerKey('restarted'));
    await starting;
    expect(decodeWorkerRecord((await redis.get(names.workerKey('restarted')))!)?.startedAt).not.toBe(1);
    await beats.stop();
  });

  it('refuses to start beside a live process that rewrites the record under its id', async () => {
    await redis.set(names.workerKey('twice'), foreign('twice', 0), 'PX', 1_000);
    const other = setInterval(() => void redis.set(names.workerKey('twice'), foreign('twice', Date.now()), 'PX', 1_000), 20);
    try {
      await expect(heartbeat('twice').start()).rejects.toThrow(StartupError);
      await expect(heartbeat('twice').start()).rejects.toThrow('found WORKER_ID=twice in use by a live worker');
    } finally {
      clearInterval(other);
    }
  });

  it('says once when a beat replaced another process’s record under its id', async () => {
    const errors: string[] = [];
    const beats = heartbeat('shared', errors);
    await beats.start();
    await redis.set(names.workerKey('shared'), foreign('shared', Date.now()));
    await beats.beat();
    await redis.set(names.workerKey('shared'), foreign('shared', Date.now()));
    await beats.beat();
    expect(errors.filter((msg) => msg.startsWith('another live worker writes this WORKER_ID'))).toHaveLength(1);
    await beats.stop();
  });
});
