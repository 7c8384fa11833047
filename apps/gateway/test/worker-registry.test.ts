import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import { redisNames, type WorkerRecord } from '@sluice/protocol';
import { redisForTests } from '../../../test/support/redis-for-tests.js';
import { register as registerIn, workerRecord } from '../../../test/support/worker-records.js';
import { WorkerRegistry } from '../src/worker-registry.js';

const names = redisNames('reg');
const store = redisForTests();
const record = (workerId: string, startedAt: number) =>
  workerRecord(workerId, { startedAt, queueWorkerId: `queue-${workerId}-${startedAt}` });
const register = (entry: WorkerRecord) => registerIn(store.redis, names, entry);

describe('the gateway’s view of the worker registry', () => {
  it('reports a worker whose record went, and one whose id came back under another process, as lost (once), with their last records', async () => {
    const reads: Array<{ live: string[]; lost: WorkerRecord[] }> = [];
    const registry = new WorkerRegistry(store.redis, names, 60_000, pino({ level: 'silent' }), (live, _takenAt, lost) =>
      reads.push({ live: [...live].sort(), lost: [...lost] }),
    );
    const a = record('a', 1);
    const b = record('b', 1);
    await register(a);
    await register(b);
    await registry.refresh();
    expect(reads.at(-1)).toEqual({ live: ['a', 'b'], lost: [] });

    // `a` died and a process under its id registered before a read saw it missing: lost at once. `b`
    // is gone: missing from one read, it still counts; missing from the next too, it is lost.
    const a2 = record('a', 2);
    await register(a2);
    await store.redis.del(names.workerKey('b'));
    await registry.refresh();
    expect(reads.at(-1)).toEqual({ live: ['b'], lost: [a] });
    // The new `a` serves: its model is listed, and the next read counts it live.
    expect(registry.models().map((model) => model.id)).toEqual(['m']);
    await registry.refresh();
    expect(reads.at(-1)).toEqual({ live: ['a'], lost: [b] });
    await registry.refresh();
    expect(reads.at(-1)).toEqual({ live: ['a'], lost: [] });
    registry.stop();
  });

  it('takes a record missing from one read and back in the next (a Redis that stalled past the TTL) for no loss', async () => {
    const reads: Array<{ live: string[]; lost: WorkerRecord[] }> = [];
    const registry = new WorkerRegistry(store.redis, redisNames('stall'), 60_000, pino({ level: 'silent' }), (live, _takenAt, lost) =>
      reads.push({ live: [...live].sort(), lost: [...lost] }),
    );
    const stallNames = redisNames('stall');
    const c = record('c', 1);
    await registerIn(store.redis, stallNames, c);
    await registry.refresh();
    // Expired while Redis served nobody; its beat lands as Redis serves again, after that first read.
    await store.redis.del(stallNames.workerKey('c'));
    await registry.refresh();
    expect(reads.at(-1)).toEqual({ live: ['c'], lost: [] });
    expect(registry.liveWorkerCount).toBe(1);
    await registerIn(store.redis, stallNames, { ...c, heartbeatAt: Date.now() });
    await registry.refresh();
    await registry.refresh();
    expect(reads.slice(-2)).toEqual([
      { live: ['c'], lost: [] },
      { live: ['c'], lost: [] },
    ]);
    registry.stop();
  });
});
