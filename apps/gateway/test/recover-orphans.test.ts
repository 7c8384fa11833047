import { Queue, Worker } from 'bullmq';
import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import { attemptJobId, GENERATE_QUEUE, redisNames, type GenerateJob } from '@sluice/protocol';
import { redisForTests } from '../../../test/support/redis-for-tests.js';
import { register, workerRecord } from '../../../test/support/worker-records.js';
import { RedisJobQueue } from '../src/job-queue.js';

/**
 * The gateway's moves among BullMQ's jobs on a real Redis and BullMQ. `recoverOrphans`: a job taken
 * (active, locked) and never accepted by a worker whose record is gone is moved at a gateway's start;
 * one whose worker is live, or judged while a live worker's record carries no BullMQ id, is not.
 * `migrate`: nothing moves once the lost attempt's job is gone. The looks through the queue read job
 * ids, never every job's data.
 */

const store = redisForTests();
const format = { endpoint: 'chat' as const, model: 'm', created: 1, includeUsage: false, n: 1, maxTokensParam: 'max_tokens' as const };

/** A gateway's job queue under its own prefix, a taker that takes jobs as a worker would, and a job maker. */
function fixture(prefix: string) {
  const names = redisNames(prefix);
  const connection = store.server.client();
  const queue = new Queue(GENERATE_QUEUE, { connection, prefix: names.bullPrefix });
  const jobs = new RedisJobQueue(queue, connection, names, `gw-${prefix}`, 60_000, 3, pino({ level: 'silent' }));
  const takerConnection = store.server.client();
  const taker = new Worker(GENERATE_QUEUE, undefined, { connection: takerConnection, prefix: names.bullPrefix, autorun: false });
  const job = (requestId: string, promptTokenIds = [1, 2]): GenerateJob => ({
    requestId,
    channel: 'gw-old',
    model: 'm',
    input: { kind: 'tokens', promptTokenIds },
    sampling: { maxTokens: 4 },
    defaultMaxTokens: 4,
    resumeGraceMs: 0,
    enqueuedAt: Date.now(),
    deadlineAt: Date.now() + 60_000,
  });
  const close = async () => {
    await taker.close(true);
    takerConnection.disconnect();
    await queue.close();
    connection.disconnect();
  };
  return { names, queue, jobs, taker, job, close };
}

describe('the gateway’s moves among BullMQ’s jobs', () => {
  it('moves a job a gone worker took and never accepted, and only when every live record can be told from its lock', async () => {
    const { names, queue, jobs, taker, job, close } = fixture('orphans');
    await jobs.submit(job('req-1'), format);
    // A worker takes it (active, locked by its token) and is gone before it accepted it.
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

    // The continuation, taken in turn by a worker gone before it accepted, moves on: the request and
    // attempt are read off its job id (`req-1.a2`).
    expect((await taker.getNextJob(`${taker.id}:1`))?.id).toBe(attemptJobId('req-1', 2));
    await expect(jobs.recoverOrphans(() => false)).resolves.toBe(1);
    expect(await redis.hget(names.metaKey('req-1'), 'attempt')).toBe('3');
    expect((await queue.getJob(attemptJobId('req-1', 3)))?.data).toMatchObject({ requestId: 'req-1', continuation: { attempt: 3 } });

    await close();
  });

  it('takes a worker that either of two registry reads finds for live (a Redis back from a stall serves its beat late)', async () => {
    const { names, jobs, taker, job, close } = fixture('confirm');
    await jobs.submit(job('late-1'), format);
    await taker.getNextJob(`${taker.id}:0`);
    const { redis } = store;
    await register(redis, names, workerRecord('other', { queueWorkerId: 'queue-other' }));
    // The taker's record expired in the stall; its queued beat lands between the two reads.
    const beat = new Promise((resolve) => setTimeout(resolve, 250)).then(() =>
      register(redis, names, workerRecord('taker', { queueWorkerId: taker.id })),
    );
    await expect(jobs.recoverOrphans(() => false, 600)).resolves.toBe(0);
    await beat;
    expect(await redis.hget(names.metaKey('late-1'), 'attempt')).toBe('1');
    // Gone from both reads: moved.
    await redis.del(names.workerKey('taker'));
    await expect(jobs.recoverOrphans(() => false, 100)).resolves.toBe(1);
    await close();
  });

  it("moves nothing once the lost attempt's job is gone (its worker settled it: the log says how it ended)", async () => {
    const { names, queue, jobs, taker, job, close } = fixture('settled');
    await jobs.submit(job('done-1'), format);
    const token = `${taker.id}:0`;
    const taken = await taker.getNextJob(token);
    await store.redis.hset(names.metaKey('done-1'), 'workerId', 'w-settled');
    // The worker (taken for lost: Redis stalled) settles the job — removed on completion — as the move is made.
    await taken?.moveToCompleted('done', token, false);
    await expect(jobs.migrate('done-1', 1, 'w-settled')).resolves.toEqual({ outcome: 'gone' });
    // Not fenced out, no continuation: the attempt stays the one that wrote the log.
    expect(await store.redis.hget(names.metaKey('done-1'), 'attempt')).toBe('1');
    expect(await queue.getJob(attemptJobId('done-1', 2))).toBeUndefined();
    // A newer attempt has it (another gateway moved it, and that job is gone too): `moved`, to adopt it.
    await store.redis.hset(names.metaKey('done-1'), 'attempt', '2');
    await expect(jobs.migrate('done-1', 1, 'w-settled')).resolves.toEqual({ outcome: 'moved', attempt: 2 });

    await close();
  });

  it("looks through the queue's jobs by their ids: no job's data (its prompt) is read", async () => {
    const { names, queue, jobs, taker, job, close } = fixture('scan');
    const requestIds = ['scan-1', 'scan-2', 'scan-3'];
    const prompt = Array.from({ length: 4096 }, (_, i) => i);
    for (const requestId of requestIds) await jobs.submit(job(requestId, prompt), format, 'owner-1');
    // Two taken (active) by a worker gone before it accepted them, one still waiting.
    await taker.getNextJob(`${taker.id}:0`);
    await taker.getNextJob(`${taker.id}:1`);
    const { redis } = store;
    await register(redis, names, workerRecord('other', { queueWorkerId: 'queue-other' }));

    // Every command Redis runs meanwhile, the scripts' own included.
    const monitor = await redis.duplicate().monitor();
    const commands: string[][] = [];
    monitor.on('monitor', (_time: string, args: string[]) => commands.push(args));
    await redis.ping(); // the monitor is on once a later command shows in it
    await expect(jobs.recoverOrphans(() => false)).resolves.toBe(2);
    // The revoked key's requests are none detached (their channel is a gateway's): nothing to stop.
    await expect(jobs.cancelDetachedOf('owner-1')).resolves.toBe(0);
    // The two jobs stay active under the dead lock, of an attempt their metas no longer name: not moved again.
    await expect(jobs.recoverLost([workerRecord('gone', { queueWorkerId: taker.id })], () => false)).resolves.toBe(0);
    await redis.ping();
    monitor.disconnect();

    // Reads of a job's hash (its data): one for each job moved (its continuation copies the data),
    // none for the scans — three of them, over two active jobs and a waiting one.
    const dataReads = (requestId: string): number =>
      commands.filter(([command, ...args]) => /^h(getall|get|mget)$/i.test(command ?? '') && args.includes(queue.toKey(requestId))).length;
    expect(commands.some(([command]) => command?.toLowerCase() === 'ping')).toBe(true);
    expect(requestIds.map(dataReads)).toEqual([1, 1, 0]);

    await close();
  });
});
