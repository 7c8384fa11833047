import { Worker, type Job } from 'bullmq';
import { Redis } from 'ioredis';
import type { Logger } from 'pino';
import type { Engine, StepStats } from '@sluice/engine';
import { GENERATE_QUEUE, redisNames } from '@sluice/protocol';
import { CancelListener } from './cancel-listener.js';
import type { WorkerConfig } from './config.js';
import { HealthServer } from './health-server.js';
import { JobProcessor, SHUTDOWN_REASON, type WorkerHooks } from './processor.js';
import type { PromptEncoder } from './prompt-encoder.js';
import { RegistryHeartbeat } from './registry-heartbeat.js';
import { StepPublisher } from './step-publisher.js';

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

function withTimeout<T>(promise: Promise<T>, ms: number): Promise<'timeout' | T> {
  let timer: NodeJS.Timeout | undefined;
  return Promise.race([promise, new Promise<'timeout'>((resolve) => (timer = setTimeout(() => resolve('timeout'), ms)))]).finally(
    () => clearTimeout(timer),
  );
}

/** Wires a running engine to Redis: BullMQ worker, step publisher, cancel listener, registry heartbeat. */
export async function startWorker(
  config: WorkerConfig,
  deps: { engine: Engine; prompts: PromptEncoder; modelId: string; logger: Logger; hooks?: WorkerHooks },
): Promise<RunningWorker> {
  const { engine, prompts, modelId, logger } = deps;
  const names = redisNames(config.redisPrefix);
  // BullMQ needs `maxRetriesPerRequest: null` on worker connections (blocking commands).
  const redis = new Redis(config.redisUrl, { maxRetriesPerRequest: null, lazyConnect: true });
  const subscriber = new Redis(config.redisUrl, { maxRetriesPerRequest: null, lazyConnect: true });
  const bullConnection = new Redis(config.redisUrl, { maxRetriesPerRequest: null, lazyConnect: true });
  for (const [name, connection] of [['commands', redis], ['subscriber', subscriber], ['queue', bullConnection]] as const) {
    connection.on('error', (err: Error) => logger.warn({ err: err.message, connection: name }, 'redis connection error'));
  }
  await Promise.all([redis.connect(), subscriber.connect(), bullConnection.connect()]);

  const publisher = new StepPublisher(redis, config.workerId, logger);
  const cancels = new CancelListener(subscriber, names.cancelChannel, logger);
  await cancels.start();
  let lastStep: StepStats | undefined;
  let steps = 0;
  const processor = new JobProcessor({
    engine,
    prompts,
    publisher,
    cancels,
    redis,
    names,
    workerId: config.workerId,
    logger,
    ...(deps.hooks === undefined ? {} : { hooks: deps.hooks }),
  });

  engine.onStep((stats) => {
    lastStep = stats;
    steps++;
  });
  let draining = false;
  const heartbeat = new RegistryHeartbeat(
    redis,
    names,
    config.ttlMs,
    config.heartbeatMs,
    () => ({
      workerId: config.workerId,
      modelId,
      maxContextLength: engine.info.maxContextLength,
      maxBatchSize: engine.info.maxBatchSize,
      running: processor.counters.running,
      draining,
    }),
    logger,
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
    lastCancel: processor.counters.lastCancel ?? null,
  }));
  const healthPort = await health.listen(config.metricsPort, config.metricsHost);

  // Registered before taking jobs: a gateway must know this worker by the time it accepts one.
  await heartbeat.start();
  const worker = new Worker(
    GENERATE_QUEUE,
    async (job: Job, _token?: string, signal?: AbortSignal) => processor.process(job.data, job.attemptsStarted, signal),
    {
      connection: bullConnection,
      prefix: names.bullPrefix,
      concurrency: config.concurrency,
      lockDuration: config.lockDurationMs,
      stalledInterval: config.lockDurationMs,
      maxStalledCount: 1,
      removeOnComplete: { count: 0 },
      removeOnFail: { count: 0 },
    },
  );
  worker.on('error', (err: Error) => logger.warn({ err: err.message }, 'bullmq worker error'));
  await worker.waitUntilReady();
  logger.info(
    { workerId: config.workerId, modelId, maxBatchSize: engine.info.maxBatchSize, concurrency: config.concurrency, healthPort },
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
      logger.warn({ running: processor.counters.running }, 'drain timeout: ending the running sequences');
      cancels.abortAll(SHUTDOWN_REASON);
      if ((await withTimeout(closing, 5_000)) === 'timeout') await withTimeout(worker.close(true), 5_000);
    }
    const steps: Array<[string, () => Promise<unknown>]> = [
      ['publisher', () => publisher.drained()],
      ['registry', () => heartbeat.stop()],
      ['engine', () => withTimeout(engine.close(), 5_000)],
      ['cancel listener', () => cancels.close()],
      ['health server', () => health.close()],
      ['redis', () => redis.quit()],
      ['queue connection', () => bullConnection.quit()],
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
