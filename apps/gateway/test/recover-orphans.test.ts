import { Queue, Worker } from 'bullmq';
import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import { attemptJobId, GENERATE_QUEUE, redisNames, type GenerateJob } from '@sluice/protocol';
import { redisForTests } from '../../../test/support/redis-for-tests.js';
import { register, workerRecord } from '../../../test/support/worker-records.js';
import { RedisJobQueue } from '../src/job-queue.js';

/**
 * `RedisJobQueue.recoverOrphans` on a real Redis and BullMQ: a job taken (active, locked) and never
 * accepted by a worker whose record is gone is moved at a gateway's start; one whose worker is live, or
 * judged while a live worker's record carries no BullMQ id, is not.
 */

const store = redisForTests();

describe('moving the requests of workers gone before a gateway started', () => {
  it('moves a job a gone worker took and never accepted, and only when every live record can be told from its lock', async () => {
    const names = redisNames('orphans');
    const connection = store.server.client();
    const queue = new Queue(GENERATE_QUEUE, { connection, prefix: names.bullPrefix });
    const jobs = new RedisJobQueue(queue, connection, names, 'gw-start', 60_000, 3, pino({ level: 'silent' }));
    const job: GenerateJob = {
      requestId: 'req-1',
      channel: 'gw-old',
      model: 'm',
      input: { kind: 'tokens', promptTokenIds: [1, 2] },
      sampling: { maxTokens: 4 },
      defaultMaxTokens: 4,
      resumeGraceMs: 0,
      enqueuedAt: Date.now(),
      deadlineAt: Date.now() + 60_000,
    };
    const format = { endpoint: 'chat' as const, model: 'm', created: 1, includeUsage: false, n: 1, maxTokensParam: 'max_tokens' as const };
    await jobs.submit(job, format);
    // A worker takes it (active, locked by its token) and is gone before it accepted it.
    const taker = new Worker(GENERATE_QUEUE, undefined, { connection: store.server.client(), prefix: names.bullPrefix, autorun: false });
    expect((await taker.getNextJob(`${taker.id}:0`))?.id).toBe('req-1');
    const { redis } = store;

    // A live worker from before records carried the BullMQ id: nothing can be told of the lock.
    await register(redis, names, workerRecord('old-version'));
    await expect(jobs.recoverOrphans(() => false)).resolves.toBe(0);
    await redis.del(names.workerKey('old-version'));
    // The taker is live: its lock is accounted for.
    await register(redis, names, workerRecord('taker', { queueWorkerId: taker.id }));
    await expect(jobs.recoverOrphans(() => false)).resolves.toBe(0);
    await redis.del(names.workerKey('taker'));
    // Only another worker is live: the lock is a gone worker's, and the request moves, its route kept.
    await register(redis, names, workerRecord('other', { queueWorkerId: 'queue-other' }));
    await expect(jobs.recoverOrphans(() => false)).resolves.toBe(1);
    expect(await redis.hmget(names.metaKey('req-1'), 'attempt', 'channel')).toEqual(['2', 'gw-old']);
    expect((await queue.getJob(attemptJobId('req-1', 2)))?.data).toMatchObject({ requestId: 'req-1', continuation: { attempt: 2 } });
    // Made once: a second gateway's start finds it moved.
    await expect(jobs.recoverOrphans(() => false)).resolves.toBe(0);

    await taker.close(true);
    await queue.close();
    connection.disconnect();
  });
});
