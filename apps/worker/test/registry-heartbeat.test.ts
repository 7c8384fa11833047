import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import { decodeWorkerRecord, encodeWorkerRecord, redisNames } from '@sluice/protocol';
import { redisForTests } from '../../../test/support/redis-for-tests.js';
import { workerRecord } from '../../../test/support/worker-records.js';
import { RegistryHeartbeat } from '../src/registry-heartbeat.js';
import { StartupError } from '../src/startup-error.js';

const names = redisNames('hb');
const store = redisForTests();

/** Another process's record under `workerId` (as it would write it), with a TTL. */
const foreign = (workerId: string, heartbeatAt: number): string => encodeWorkerRecord(workerRecord(workerId, { heartbeatAt }));

function heartbeat(workerId: string, errors: string[] = []) {
  const logger = pino({ level: 'warn' }, { write: (line: string) => void errors.push((JSON.parse(line) as { msg: string }).msg) });
  return new RegistryHeartbeat(
    store.redis,
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
    await store.redis.set(names.workerKey('restarted'), dead, 'PX', 10_000);
    const beats = heartbeat('restarted');
    let registered = false;
    const starting = beats.start().then(() => (registered = true));
    await new Promise((resolve) => setTimeout(resolve, 300));
    expect(registered).toBe(false);
    expect(await store.redis.get(names.workerKey('restarted'))).toBe(dead);
    // It expires (here: goes now).
    await store.redis.del(names.workerKey('restarted'));
    await starting;
    expect(decodeWorkerRecord((await store.redis.get(names.workerKey('restarted')))!)?.startedAt).not.toBe(1);
    await beats.stop();
  });

  it('refuses to start beside a live process that rewrites the record under its id', async () => {
    await store.redis.set(names.workerKey('twice'), foreign('twice', 0), 'PX', 1_000);
    const other = setInterval(() => void store.redis.set(names.workerKey('twice'), foreign('twice', Date.now()), 'PX', 1_000), 20);
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
    await store.redis.set(names.workerKey('shared'), foreign('shared', Date.now()));
    await beats.beat();
    await store.redis.set(names.workerKey('shared'), foreign('shared', Date.now()));
    await beats.beat();
    expect(errors.filter((msg) => msg.startsWith('another live worker writes this WORKER_ID'))).toHaveLength(1);
    await beats.stop();
  });
});
