import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Redis } from 'ioredis';
import { redisNames } from '@sluice/protocol';
import { Cluster } from './support/cluster.js';
import { jobLock, startJobTaker } from './support/job-taker-process.js';
import { waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { readTokenLog } from './support/token-log.js';
import { chatBody, MIGRATING_GATEWAY_ENV, MIGRATING_WORKER_ENV, notWhole, post, readReply, resume } from './stress/stress-support.js';

/**
 * A worker that dies after BullMQ gave it a job and before it accepted it (the job active, locked by
 * the dead worker; nothing in the request's log; no gateway knows which worker had it): the request
 * moves on as soon as a gateway sees the worker lost (its registry key expired), instead of when the
 * dead worker's BullMQ lock lapses and a stalled-job check runs (30–60 s; past the queue timeout, the
 * client got `queue_timeout`). Real redis-server, BullMQ, gateways and workers (tiny model); the dying
 * worker is `support/job-taker.ts` (a process that takes one job off the real queue as a worker does
 * and never accepts it), SIGKILLed.
 */

const names = redisNames();

describe('a worker lost between taking a job and accepting it', () => {
  let cluster: Cluster;
  let gateways: GatewayProcess[];
  let worker: WorkerProcess;
  let redis: Redis;

  beforeAll(async () => {
    cluster = await Cluster.start();
    worker = await cluster.worker(MIGRATING_WORKER_ENV);
    gateways = [await cluster.gateway(MIGRATING_GATEWAY_ENV), await cluster.gateway(MIGRATING_GATEWAY_ENV)];
    redis = new Redis(cluster.redis.url);
  });
  afterAll(async () => {
    redis?.disconnect();
    await cluster?.stop();
  });

  const answerOf = async (content: string) => {
    const got = await readReply(post(gateways[0]!, chatBody(content, 24)).reply);
    expect(got.errors).toEqual([]);
    return got.text;
  };

  /**
   * Leaves the job taker as the only consumer of the queue: it registers (copying the live worker's
   * record), then the live worker stops (SIGTERM, drained). Resolves its process and BullMQ worker id.
   */
  const onlyTheTaker = async (takerId: string) => {
    const taker = await startJobTaker(cluster.redis.url, takerId, MIGRATING_WORKER_ENV.WORKER_TTL_MS);
    await worker.process.stop();
    return taker;
  };
  const lockOf = (jobId: string) => jobLock(redis, jobId);

  /** `sluice_gateway_stream_migrations_total` summed over both gateways. */
  const movesCounted = async () => {
    let sum = 0;
    for (const gateway of gateways)
      sum += (await scrapePrometheus(`${gateway.url}/metrics`)).value('sluice_gateway_stream_migrations_total');
    return sum;
  };

  /** A request the taker took whose client then left within its grace (detached): its stream id, to resume it. */
  const takenThenLeft = async (takerId: string, prompt: string) => {
    const taker = await onlyTheTaker(takerId);
    const first = post(gateways[0]!, chatBody(prompt, 24));
    const streamId = (await first.reply).headers.get('x-stream-id')!;
    const jobId = await taker.took();
    first.leave();
    await waitFor(
      'the request detached',
      async () => ((await redis.hget(names.metaKey(jobId), 'channel')) === '' ? true : undefined),
      10_000,
    );
    return { taker, streamId, jobId };
  };

  /** The log of a request moved once before its first entry: one attempt, 2, accepted at seq 0, not as a continuation. */
  const expectMovedBeforeAnything = async (jobId: string) => {
    expect(await redis.hget(names.metaKey(jobId), 'attempt')).toBe('2');
    const log = await readTokenLog(redis, jobId);
    const accepted = log.filter((entry) => entry.type === 'accepted');
    expect(accepted).toHaveLength(1);
    expect(accepted[0]).toMatchObject({ seq: 0, attempt: 2 });
    expect(accepted[0]).not.toHaveProperty('continued', true);
    expect(new Set(log.map((entry) => entry.attempt))).toEqual(new Set([2]));
  };

  it('streams the whole answer to the client waiting for it, long before the dead worker\u2019s lock lapses', async () => {
    const prompt = 'Tell me about the lighthouse keeper.';
    const expected = await answerOf(prompt);
    const movesBefore = await movesCounted();
    const taker = await onlyTheTaker('taker-a');
    const { reply } = post(gateways[0]!, chatBody(prompt, 24));
    const jobId = await taker.took();
    taker.process.signal('SIGKILL');
    await taker.process.exited;
    worker = await cluster.worker(MIGRATING_WORKER_ENV);

    const got = await readReply(reply);
    expect(notWhole(got, expected), cluster.logs()).toBeUndefined();
    // Moved by one gateway, counted once over both.
    await waitFor('the move counted', async () => ((await movesCounted()) === movesBefore + 1 ? true : undefined), 5_000);
    // Moved by a gateway: the first job is still active, locked by the dead worker (BullMQ would hand
    // it on only once that lock lapsed, LOCK_DURATION_MS = 30 s after the take).
    expect(await lockOf(jobId)).toMatch(new RegExp(`^${taker.queueWorkerId}:`));
    await expectMovedBeforeAnything(jobId);
  }, 90_000);

  it('fences out a worker that only looked dead (frozen past its TTL): what it writes once thawed reaches neither the log nor the client', async () => {
    const prompt = 'Tell me about the old mill.';
    const expected = await answerOf(prompt);
    const taker = await onlyTheTaker('taker-c');
    const { reply } = post(gateways[0]!, chatBody(prompt, 24));
    const jobId = await taker.took();
    taker.process.signal('SIGSTOP');
    await waitFor(
      'the request moved',
      async () => ((await redis.hget(names.metaKey(jobId), 'attempt')) === '2' ? true : undefined),
      20_000,
    );
    // Thawed before any worker takes the new attempt: its `accepted` and a first token, appended
    // (refused: fenced out) and published to the waiting client's gateway, as a worker's step writes them.
    taker.process.signal('SIGCONT');
    taker.process.signal('SIGUSR1');
    expect(await waitFor('the late write', async () => /wrote (\d)/.exec(taker.process.output())?.[1], 10_000)).toBe('0');
    worker = await cluster.worker(MIGRATING_WORKER_ENV);

    const got = await readReply(reply);
    taker.process.signal('SIGKILL');
    expect(notWhole(got, expected), cluster.logs()).toBeUndefined();
    await expectMovedBeforeAnything(jobId);
  }, 90_000);

  it('moves a request whose client left within its grace; the client resumes the whole answer on another gateway', async () => {
    const prompt = 'Tell me about the night ferry.';
    const expected = await answerOf(prompt);
    const { taker, streamId, jobId } = await takenThenLeft('taker-b', prompt);
    taker.process.signal('SIGKILL');
    await taker.process.exited;
    worker = await cluster.worker(MIGRATING_WORKER_ENV);

    // No gateway holds a session of it: a gateway that saw the taker lost moved it, detached still,
    // and the new worker generated the answer into its log for the client to resume.
    await waitFor(
      'the answer in the log',
      async () => ((await readTokenLog(redis, jobId)).some((e) => e.type === 'finish') ? true : undefined),
      30_000,
    );
    expect(await redis.hget(names.metaKey(jobId), 'channel')).toBe('');
    const got = await readReply(resume(gateways[1]!, streamId));
    expect(notWhole(got, expected), cluster.logs()).toBeUndefined();
    expect(await lockOf(jobId)).toMatch(new RegExp(`^${taker.queueWorkerId}:`));
    await expectMovedBeforeAnything(jobId);
  }, 90_000);

  it('is moved by a gateway that started after the worker was gone (it never saw its record)', async () => {
    const prompt = 'Tell me about the tide tables.';
    const expected = await answerOf(prompt);
    const { taker, streamId, jobId } = await takenThenLeft('taker-d', prompt);
    // The gateways that saw the taker are frozen through its death: none of them moves the request.
    for (const gateway of gateways) gateway.process.signal('SIGSTOP');
    try {
      taker.process.signal('SIGKILL');
      await taker.process.exited;
      await waitFor(
        'the taker’s record gone',
        async () => ((await redis.exists(names.workerKey('taker-d'))) === 0 ? true : undefined),
        10_000,
      );
      worker = await cluster.worker(MIGRATING_WORKER_ENV);
      const late = await cluster.gateway(MIGRATING_GATEWAY_ENV);
      await waitFor(
        'the answer in the log',
        async () => ((await readTokenLog(redis, jobId)).some((e) => e.type === 'finish') ? true : undefined),
        30_000,
      );
      expect(notWhole(await readReply(resume(late, streamId)), expected), cluster.logs()).toBeUndefined();
    } finally {
      for (const gateway of gateways) gateway.process.signal('SIGCONT');
    }
    expect(await lockOf(jobId)).toMatch(new RegExp(`^${taker.queueWorkerId}:`));
    await expectMovedBeforeAnything(jobId);
  }, 90_000);
});
