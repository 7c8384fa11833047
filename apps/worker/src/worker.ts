import { Queue, Worker, type Job } from 'bullmq';
import { Redis } from 'ioredis';
import type { Logger } from 'pino';
import type { Engine, StepStats } from '@sluice/engine';
import { QUEUE_JOB_STATES, type WorkerMetrics } from '@sluice/metrics';
import { connectRedis, GENERATE_QUEUE, redactRedisUrl, redisNames, type ModelCard } from '@sluice/protocol';
import { ControlListener } from './control-listener.js';
import type { WorkerConfig } from './config.js';
import { HealthServer } from './health-server.js';
import { RequestHandover } from './handover.js';
import { HANDOVER_REASON, JobProcessor, type WorkerHooks } from './processor.js';
import { RegistryHeartbeat } from './registry-heartbeat.js';
import { StartupError, startupStep } from './startup-error.js';
import { StepRouter } from './step-router.js';

export interface RunningWorker {
  readonly workerId: string;
  readonly modelId: string;
  /** Port of `/healthz` (and later `/metrics`). */
  readonly healthPort: number;
  readonly health: HealthServer;
  readonly processor: JobProcessor;
  /** The BullMQ queue's name and prefix, for queue-depth metrics. */
  readonly queue: { name: string; prefix: string };
  /** Stop taking jobs, let running sequences finish within `drainTimeoutMs`, end the rest, release everything. */
  drain(): Promise<void>;
}

/** Longest wait between two reconnect attempts to Redis. */
const RECONNECT_MAX_MS = 250;
/** BullMQ's pause after a failed fetch (its default is 15 s): jobs flow again ~1 s after Redis returns. */
const FETCH_RETRY_MS = 500;

function withTimeout<T>(promise: Promise<T>, ms: number): Promise<'timeout' | T> {
  let timer: NodeJS.Timeout | undefined;
  return Promise.race([promise, new Promise<'timeout'>((resolve) => (timer = setTimeout(() => resolve('timeout'), ms)))]).finally(() =>
    clearTimeout(timer),
  );
}

/** Wires a running engine to Redis: BullMQ worker, step router (live path + token log), control listener, registry heartbeat. */
export async function startWorker(
  config: WorkerConfig,
  deps: {
    engine: Engine;
    /** Published for gateways, which tokenize and check prompts (workers take token ids only). */
    modelCard?: ModelCard;
    modelId: string;
    logger: Logger;
    hooks?: WorkerHooks;
    /** Served on `GET /metrics` of the health server and fed from the engine, the processor and BullMQ. */
    metrics?: WorkerMetrics;
  },
): Promise<RunningWorker> {
  const { engine, modelId, logger, metrics } = deps;
  const names = redisNames(config.redisPrefix);
  // Every connection retries every ≤ 250 ms (ioredis's default backoff grows to 2 s): back to work
  // about as soon as Redis is.
  const retryStrategy = (times: number) => Math.min(50 * times, RECONNECT_MAX_MS);
  // The command connection (step writes, request state) queues nothing while Redis is away: a step
  // that cannot be written fails now, and its streams are ended (StepRouter), instead of piling up in
  // memory and replaying to gateways that already failed them. The heartbeat has a connection of its
  // own: behind a backlog of steps (Redis reads a client's backlog a slice per turn after a stall) a
  // beat would land late, and gateways take a worker whose record two of their reads lack for lost.
  // Named (CLIENT LIST shows whose connection is whose): `sluice-worker:<workerId>:<role>` (a name
  // may not hold spaces).
  const named = (role: string) => ({ connectionName: `sluice-worker:${config.workerId.replace(/[^\w.:-]/g, '-')}:${role}` });
  /** A connection that queues nothing while Redis is away (a command fails at once). */
  const failFast = (role: string) =>
    new Redis(config.redisUrl, { maxRetriesPerRequest: 1, enableOfflineQueue: false, lazyConnect: true, retryStrategy, ...named(role) });
  const redis = failFast('commands');
  // BullMQ needs `maxRetriesPerRequest: null` on its connections (blocking commands).
  const subscriber = new Redis(config.redisUrl, { maxRetriesPerRequest: null, lazyConnect: true, retryStrategy, ...named('subscriber') });
  const bullConnection = new Redis(config.redisUrl, { maxRetriesPerRequest: null, lazyConnect: true, retryStrategy, ...named('queue') });
  const registryConnection = failFast('registry');
  await connectRedis(
    [
      ['commands', redis],
      ['subscriber', subscriber],
      ['queue', bullConnection],
      ['registry', registryConnection],
    ],
    (err, connection) => logger.warn({ err, connection }, 'redis connection error'),
  ).catch((cause: Error) => {
    throw new StartupError(`cannot connect to Redis at ${redactRedisUrl(config.redisUrl)}`, cause);
  });

  const router = new StepRouter(
    redis,
    { workerId: config.workerId, names, retentionMs: config.streamRetentionMs, maxLogEntries: config.maxLogEntries },
    logger,
  );
  const stopRouting = engine.onEvents(router.onEvents);
  const controls = new ControlListener(subscriber, names.controlChannel, router, logger, redis, names.cancelMarkerKey);
  await controls.start();
  let lastStep: StepStats | undefined;
  let steps = 0;
  const queue = new Queue(GENERATE_QUEUE, { connection: bullConnection, prefix: names.bullPrefix });
  queue.on('error', (err: Error) => logger.warn({ err: err.message }, 'queue error'));
  const processor = new JobProcessor({
    engine,
    router,
    controls,
    redis,
    names,
    workerId: config.workerId,
    logger,
    handover: new RequestHandover(redis, queue, names, config.workerId),
    hooks: {
      requestFinished(stats) {
        metrics?.observeRequestFinished(stats);
        deps.hooks?.requestFinished?.(stats);
      },
    },
  });

  // LOG_LEVEL=trace: a line per step (what it ran, how long it took), to read a latency spike step by step.
  const traceSteps = logger.isLevelEnabled('trace');
  engine.onStep((stats) => {
    lastStep = stats;
    steps++;
    if (traceSteps) logger.trace(stats, 'step');
    metrics?.observeStep(stats);
    if (stats.eventLoopLagMs !== undefined) metrics?.setEngineEventLoopLag(stats.eventLoopLagMs);
  });
  let draining = false;
  // Made first, run only once registered (`autorun: false`): its id, the prefix of every lock it takes,
  // is in the registry record before it holds a job, so that whoever sees this worker lost can find
  // the jobs it took and had not accepted yet (`RedisJobQueue.recoverLost`).
  const worker = new Worker(
    GENERATE_QUEUE,
    async (job: Job, _token?: string, signal?: AbortSignal) => {
      // The host thread's event-loop delay is measured while a job runs (an idle worker is not woken for it).
      const endWork = metrics?.eventLoopDelay.begin();
      try {
        await processor.process(job.data, job.attemptsStarted, signal);
      } finally {
        endWork?.();
      }
    },
    {
      connection: bullConnection,
      prefix: names.bullPrefix,
      concurrency: config.concurrency,
      lockDuration: config.lockDurationMs,
      stalledInterval: config.lockDurationMs,
      maxStalledCount: 1,
      runRetryDelay: FETCH_RETRY_MS,
      removeOnComplete: { count: 0 },
      removeOnFail: { count: 0 },
      autorun: false,
    },
  );
  worker.on('error', (err: Error) => logger.warn({ err: err.message }, 'bullmq worker error'));
  const heartbeat = new RegistryHeartbeat(
    registryConnection,
    names,
    config.ttlMs,
    config.heartbeatMs,
    () => ({
      workerId: config.workerId,
      modelId,
      maxContextLength: engine.info.maxContextLength,
      maxBatchSize: engine.info.maxBatchSize,
      maxCachedTokens: engine.info.maxCachedTokens,
      running: processor.counters.running,
      draining,
      queueWorkerId: worker.id,
    }),
    logger,
    deps.modelCard,
  );

  const health = new HealthServer(() => ({
    status: draining ? 'draining' : 'ok',
    workerId: config.workerId,
    modelId,
    running: processor.counters.running,
    waiting: processor.counters.running === 0 ? 0 : (lastStep?.waiting ?? 0),
    processed: processor.counters.processed,
    skipped: processor.counters.skipped,
    steps,
    // Request ids stay off this port unless a test asks for them.
    lastCancel: config.healthRequestIds ? (processor.counters.lastCancel ?? null) : null,
  }));
  // Queue depth is read at each scrape, on the worker's own BullMQ connection (the Queue reuses it).
  if (metrics !== undefined) {
    metrics.setQueueDepthSource(() => queue.getJobCounts(...QUEUE_JOB_STATES));
    health.route('/metrics', async (_req, res) => {
      const body = await metrics.scrape();
      res.writeHead(200, { 'Content-Type': metrics.registry.contentType, 'Content-Length': Buffer.byteLength(body) });
      res.end(body);
    });
  }
  const healthPort = await startupStep(`cannot listen on METRICS_HOST=${config.metricsHost} METRICS_PORT=${config.metricsPort}`, () =>
    health.listen(config.metricsPort, config.metricsHost),
  );

  // Registered before taking jobs: a gateway must know this worker by the time it accepts one.
  await heartbeat.start();
  // A Redis that came back may have lost the registry (a restart): re-register at once, not at the
  // next beat, so gateways count this worker again as soon as they can enqueue.
  registryConnection.on('ready', () => {
    if (!draining) heartbeat.beat().catch((error: unknown) => logger.warn({ err: error }, 'registry heartbeat failed'));
  });
  // Resolves once the worker closed (a drain); a rejection means it stopped taking jobs.
  worker.run().catch((err: Error) => logger.error({ err: err.message }, 'bullmq worker stopped'));
  await worker.waitUntilReady();
  logger.info(
    {
      workerId: config.workerId,
      modelId,
      maxBatchSize: engine.info.maxBatchSize,
      concurrency: config.concurrency,
      kvReservedMiB: Math.round(engine.info.kvReservedBytes / 2 ** 20),
      kvCache: engine.info.kvCache,
      groupQueryAttention: engine.info.groupQueryAttention,
      splitAttentionLayers: engine.info.splitAttentionLayers,
      intraOpThreads: engine.info.intraOpThreads,
      healthPort,
    },
    'worker ready',
  );

  const drain = async (): Promise<void> => {
    if (draining) return;
    draining = true;
    logger.info({ running: processor.counters.running, drainTimeoutMs: config.drainTimeoutMs }, 'draining');
    await heartbeat.beat().catch(() => undefined);
    // close() stops fetching and waits for the running jobs, forever by itself: bound it.
    const closing = worker.close();
    if ((await withTimeout(closing, config.drainTimeoutMs)) === 'timeout') {
      logger.warn({ running: processor.counters.running }, 'drain timeout: handing the running requests over to other workers');
      controls.abortAll(HANDOVER_REASON);
      if ((await withTimeout(closing, 5_000)) === 'timeout') await withTimeout(worker.close(true), 5_000);
    }
    const steps: Array<[string, () => Promise<unknown>]> = [
      [
        'router',
        async () => {
          await router.drained();
          stopRouting();
        },
      ],
      ['registry', () => heartbeat.stop()],
      // The last steps' and requests' counts are in: one more scrape reads them before the process goes.
      ['final scrape', async () => metrics?.nextScrape(config.finalScrapeMaxMs)],
      ['engine', () => withTimeout(engine.close(), 5_000)],
      ['control listener', () => controls.close()],
      ['health server', () => health.close()],
      [
        'metrics',
        async () => {
          metrics?.eventLoopDelay.close();
          metrics?.setQueueDepthSource(undefined);
          await queue.close();
        },
      ],
      ['redis', () => redis.quit()],
      ['queue connection', () => bullConnection.quit()],
      ['registry connection', () => registryConnection.quit()],
    ];
    for (const [name, step] of steps) {
      try {
        await step();
      } catch (error) {
        logger.warn({ err: error, step: name }, 'shutdown step failed');
      }
    }
    logger.info('worker stopped');
  };

  return {
    workerId: config.workerId,
    modelId,
    healthPort,
    health,
    processor,
    queue: { name: GENERATE_QUEUE, prefix: names.bullPrefix },
    drain,
  };
}
