import { Queue, Worker } from 'bullmq';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  attemptJobId,
  decodeLogRange,
  decodeRequestMeta,
  encodeRequestMeta,
  GENERATE_QUEUE,
  LOG_FIELD,
  redisNames,
} from '@sluice/protocol';
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

  it('stop a running job by the control message, its marker living only for the pickup window', async () => {
    const messages: string[] = [];
    const sub = server.client();
    await sub.subscribe(names.controlChannel);
    sub.on('message', (_channel: string, raw: string) => messages.push(raw));
    jobs.cancel(session('running-1'), 'client_closed', false);
    await expect.poll(() => messages.length).toBe(1);
    expect(JSON.parse(messages[0]!)).toMatchObject({ type: 'cancel', requestIds: ['running-1'] });
    // The marker tells a retry under the same Idempotency-Key that this answer ends `abort`; it lapses
    // with the pickup window, not the request's deadline.
    expect(await redis.exists(names.cancelMarkerKey('running-1'))).toBe(1);
    expect(await redis.pttl(names.cancelMarkerKey('running-1'))).toBeLessThanOrEqual(30_000);
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

  it('cancel a migrated request by removing its waiting continuation, and end its stream after what its log holds', async () => {
    const requestId = 'migrated-1';
    const fields = encodeRequestMeta({
      channel: 'gw-live',
      graceMs: 0,
      attempt: 2,
      enqueuedAt: Date.now(),
      deadlineAt: Date.now() + 600_000,
      format: { endpoint: 'completion', model: 'm', created: 1, includeUsage: false, n: 2, maxTokensParam: 'max_tokens' },
    });
    await redis.hset(names.metaKey(requestId), fields);
    const sent = [
      { requestId, seq: 0, type: 'accepted', workerId: 'w-lost', promptTokens: 4 },
      { requestId, seq: 1, type: 'text-delta', index: 0, text: 'a', tokenIds: [5, 6], tokens: 2 },
      { requestId, seq: 2, type: 'text-end', index: 1, finishReason: 'length' },
    ];
    for (const entry of sent) await redis.xadd(names.logKey(requestId), `${entry.seq}-1`, LOG_FIELD, JSON.stringify(entry));
    // The lost attempt's job stays active under the request's id; the continuation waits under its own.
    await queue.add('generate', { any: 1 }, { jobId: attemptJobId(requestId, 2) });
    const live: string[] = [];
    const sub = server.client();
    await sub.subscribe('gw-live');
    sub.on('message', (_channel: string, raw: string) => live.push(raw));
    await jobs.cancelRequest(requestId, decodeRequestMeta(await redis.hgetall(names.metaKey(requestId)))!);
    expect(await queue.getJob(attemptJobId(requestId, 2))).toBeUndefined();
    const ending = [
      { requestId, seq: 3, type: 'text-end', index: 0, finishReason: 'abort', attempt: 2 },
      { requestId, seq: 4, type: 'finish', usage: { promptTokens: 4, completionTokens: 2 }, attempt: 2 },
    ];
    expect(decodeLogRange(await redis.xrange(names.logKey(requestId), '-', '+')).slice(sent.length)).toEqual(ending);
    await expect.poll(() => live.length).toBe(1);
    expect(JSON.parse(live[0]!)).toEqual({ workerId: '', entries: ending });
    sub.disconnect();
  });
});
