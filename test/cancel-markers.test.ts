import { Queue, Worker } from 'bullmq';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { GENERATE_QUEUE, redisNames } from '@sluice/protocol';
import { hasRedisServer, startRedis, type RedisServer } from './support/redis-server.js';
import { RedisJobQueue } from '../apps/gateway/dist/job-queue.js';
import type { RequestSession } from '../apps/gateway/dist/request-session.js';

const names = redisNames('t');

describe.skipIf(!hasRedisServer())('cancel markers', () => {
  let server: RedisServer;
  let queue: Queue;
  let jobs: RedisJobQueue;
  let redis: ReturnType<RedisServer['client']>;

  beforeAll(async () => {
    server = await startRedis();
    redis = server.client();
    queue = new Queue(GENERATE_QUEUE, { connection: server.client(), prefix: names.bullPrefix });
    jobs = new RedisJobQueue(queue, redis, names, 'gw', 60_000, 3, pino({ level: 'silent' }));
  });

  afterAll(async () => {
    await queue?.close();
    redis?.disconnect();
    await server?.stop();
  });

  const session = (requestId: string) => ({ requestId, deadlineAt: Date.now() + 600_000 }) as RequestSession;

  it('leave no marker for a waiting job the queue removed', async () => {
    await queue.add('generate', { any: 1 }, { jobId: 'queued-1' });
    jobs.cancel(session('queued-1'), 'client_closed', true);
    await expect.poll(async () => (await queue.getJob('queued-1')) === undefined).toBe(true);
    await expect.poll(() => redis.exists(names.cancelMarkerKey('queued-1'))).toBe(0);
  });

  it('leave no marker for a running job (the control message stops it)', async () => {
    const messages: string[] = [];
    const sub = server.client();
    await sub.subscribe(names.controlChannel);
    sub.on('message', (_channel: string, raw: string) => messages.push(raw));
    jobs.cancel(session('running-1'), 'client_closed', false);
    await expect.poll(() => messages.length).toBe(1);
    expect(JSON.parse(messages[0]!)).toMatchObject({ type: 'cancel', requestIds: ['running-1'] });
    expect(await redis.exists(names.cancelMarkerKey('running-1'))).toBe(0);
    sub.disconnect();
  });

  it('keep a marker only for the pickup window when the job could not be removed', async () => {
    // A worker holds the job's lock but has not accepted it yet: the queue cannot remove it.
    await queue.add('generate', { any: 1 }, { jobId: 'taken-1' });
    const worker = new Worker(GENERATE_QUEUE, null, { connection: server.client(), prefix: names.bullPrefix, autorun: false });
    expect((await worker.getNextJob('token-1'))?.id).toBe('taken-1');
    jobs.cancel(session('taken-1'), 'client_closed', true);
    await expect.poll(() => redis.exists(names.cancelMarkerKey('taken-1'))).toBe(1);
    const ttl = await redis.pttl(names.cancelMarkerKey('taken-1'));
    expect(ttl).toBeGreaterThan(0);
    expect(ttl).toBeLessThanOrEqual(30_000);
    await worker.close(true);
  });
});
