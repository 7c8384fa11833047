import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Redis } from 'ioredis';
import { decodeWorkerRecord, redisNames } from '@sluice/protocol';
import { Cluster } from './support/cluster.js';
import { jobLock, startJobTaker } from './support/job-taker-process.js';
import { startProcess, waitFor } from './support/processes.js';
import { read, empty } from './support/sse.js';
import { WORKER_MAIN, type GatewayProcess, type WorkerProcess } from './support/sluice.js';
import { chatBody, MIGRATING_GATEWAY_ENV, MIGRATING_WORKER_ENV, notWhole, post, readReply } from './stress/stress-support.js';

/**
 * A worker that dies and comes back under the same `WORKER_ID` within its registry TTL (a fixed id, a
 * fast restart). The new process waits for the dead one's record to expire before it registers, and
 * gateways tell a new process from the old by its record's start if a read missed the gap: either way
 * the old one counts as lost, and what it held — a stream it was answering, a job it had taken and not
 * accepted — moves then, as for any lost worker, instead of when BullMQ finds the dead process's locks
 * lapsed (30–60 s). A second live worker under one id is refused. Real redis-server, BullMQ, gateways
 * and workers (tiny model), SIGKILL; the job taker of `support/job-taker.ts` for the job taken and not
 * accepted.
 */

const names = redisNames();
/** Longer than a worker's start here: the restarted process finds the dead one's record still there. */
const LONG_TTL = { ...MIGRATING_WORKER_ENV, WORKER_TTL_MS: '4000' };

describe('a worker restarted under the same WORKER_ID within its TTL', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let redis: Redis;

  beforeAll(async () => {
    cluster = await Cluster.start();
    gateway = await cluster.gateway(MIGRATING_GATEWAY_ENV, { waitReady: false });
    redis = new Redis(cluster.redis.url);
  });
  afterAll(async () => {
    redis?.disconnect();
    await cluster?.stop();
  });

  const recordOf = async (workerId: string) => decodeWorkerRecord((await redis.get(names.workerKey(workerId))) ?? '');
  const lockOf = (jobId: string) => jobLock(redis, jobId);
  /** A worker, once the gateway serves its model. */
  const started = async (env: Record<string, string>) => {
    const worker = await cluster.worker(env);
    await waitFor('the gateway ready', async () => ((await gateway.get('/readyz')).status === 200 ? true : undefined), 20_000);
    return worker;
  };
  const replaced = async (worker: WorkerProcess, env: Record<string, string>) => {
    worker.process.signal('SIGKILL');
    await worker.process.exited;
    return cluster.worker(env);
  };

  it('moves the stream the dead process was answering to the new one, token-identical', async () => {
    const env = { ...LONG_TTL, WORKER_ID: 'fixed-1' };
    let worker = await started(env);
    const body = chatBody('Tell me about the harbour at dawn.', 120);
    const expected = (await readReply(post(gateway, body).reply)).text;
    const old = await recordOf('fixed-1');

    const res = await post(gateway, body).reply;
    const got = empty();
    await read(res, got, (c) => c.textChunks >= 3);
    worker = await replaced(worker, env);
    // It registers once the dead one's record expired (or a gateway would take it for that one).
    await waitFor(
      'the new process registered',
      async () => ((await recordOf('fixed-1'))?.startedAt !== old?.startedAt ? true : undefined),
      20_000,
    );
    await read(res, got);
    expect(notWhole(got, expected), cluster.logs()).toBeUndefined();
    const jobId = got.id!.slice('chatcmpl-'.length);
    expect(await redis.hget(names.metaKey(jobId), 'attempt')).toBe('2');
    // Moved by the gateway: the first job is still held under the dead process's lock.
    expect(await lockOf(jobId)).toMatch(new RegExp(`^${old!.queueWorkerId}:`));
    await worker.process.stop();
  }, 90_000);

  it('moves a job the dead process had taken and not accepted', async () => {
    const worker = await started(MIGRATING_WORKER_ENV);
    const body = chatBody('Tell me about the salt marsh.', 24);
    const expected = (await readReply(post(gateway, body).reply)).text;
    const taker = await startJobTaker(cluster.redis.url, 'fixed-2', LONG_TTL.WORKER_TTL_MS);
    await worker.process.stop();
    const { reply } = post(gateway, body);
    const jobId = await taker.took();
    taker.process.signal('SIGKILL');
    await taker.process.exited;
    await cluster.worker({ ...LONG_TTL, WORKER_ID: 'fixed-2' });

    const got = await readReply(reply);
    expect(notWhole(got, expected), cluster.logs()).toBeUndefined();
    expect(await redis.hget(names.metaKey(jobId), 'attempt')).toBe('2');
    expect(await lockOf(jobId)).toMatch(new RegExp(`^${taker.queueWorkerId}:`));
  }, 90_000);

  it('refuses to start a second live worker under the same WORKER_ID, saying why', async () => {
    const first = await started({ ...MIGRATING_WORKER_ENV, WORKER_ID: 'fixed-3' });
    const second = startProcess('worker', process.execPath, [WORKER_MAIN], {
      REDIS_URL: cluster.redis.url,
      ...MIGRATING_WORKER_ENV,
      WORKER_ID: 'fixed-3',
      METRICS_PORT: '0',
      LOG_LEVEL: 'warn',
    });
    const { code } = await second.exited;
    expect(code).not.toBe(0);
    expect(second.output()).toContain(
      'found WORKER_ID=fixed-3 in use by a live worker: give each worker its own id, or leave WORKER_ID unset',
    );
    // The first one serves on.
    expect((await first.health()).status).toBe('ok');
    expect((await readReply(post(gateway, chatBody('Tell me about the ferry.', 8)).reply)).errors).toEqual([]);
    await first.process.stop();
  }, 90_000);
});
