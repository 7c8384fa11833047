import { Redis } from 'ioredis';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { encodeWorkerRecord, redisNames, type WorkerRecord } from '@sluice/protocol';
import { startRedis, type RedisServer } from '../../../test/support/redis-server.js';
import { WorkerRegistry } from '../src/worker-registry.js';

const names = redisNames('reg');
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

const record = (workerId: string, startedAt: number): WorkerRecord => ({
  workerId,
  modelId: 'm',
  maxContextLength: 64,
  maxBatchSize: 4,
  startedAt,
  heartbeatAt: Date.now(),
  running: 0,
  draining: false,
  queueWorkerId: `queue-${workerId}-${startedAt}`,
});

async function register(entry: WorkerRecord): Promise<void> {
  await redis
    .multi()
    .set(names.workerKey(entry.workerId), encodeWorkerRecord(entry))
    .zadd(names.workersIndexKey, Date.now(), entry.workerId)
    .exec();
}

describe('the gateway’s view of the worker registry', () => {
  it('reports a worker whose record went, and one whose id came back under another process, as lost (once), with their last records', async () => {
    const reads: Array<{ live: string[]; lost: WorkerRecord[] }> = [];
    const registry = new WorkerRegistry(redis, names, 60_000, pino({ level: 'silent' }), (live, _takenAt, lost) =>
      reads.push({ live: [...live].sort(), lost: [...lost] }),
    );
    const a = record('a', 1);
    const b = record('b', 1);
    await register(a);
    await register(b);
    await registry.refresh();
    expect(reads.at(-1)).toEqual({ live: ['a', 'b'], lost: [] });

    // `a` died and a process under its id registered before a read saw it missing; `b` is gone.
    const a2 = record('a', 2);
    await register(a2);
    await redis.del(names.workerKey('b'));
    await registry.refresh();
    expect(reads.at(-1)).toEqual({ live: [], lost: [a, b] });
    // The new `a` serves: its model is listed, and the next read counts it live.
    expect(registry.models().map((model) => model.id)).toEqual(['m']);
    await registry.refresh();
    expect(reads.at(-1)).toEqual({ live: ['a'], lost: [] });
    registry.stop();
  });
});
