import { randomBytes } from 'node:crypto';
import type { Server as HttpServer, IncomingMessage, ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { serve, type ServerType } from '@hono/node-server';
import { Queue } from 'bullmq';
import { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { connectRedis, GENERATE_QUEUE, redactRedisUrl, redisNames } from '@sluice/protocol';
import { createApp, type AppDeps, type DrainPhase } from './app.js';
import { startAccessControl } from './auth/access-control.js';
import { KeyRevocation } from './auth/key-revocation.js';
import { noKeyUsage, type KeyUsageRecorder } from './auth/key-usage-recorder.js';
import { clientErrorHandler } from './client-error.js';
import type { GatewayConfig } from './config.js';
import { GatewayError } from './errors.js';
import type { GatewayHooks } from './hooks.js';
import { IdempotencyStore } from './idempotency-store.js';
import { RedisJobQueue } from './job-queue.js';
import { readiness } from './routes/health.js';
import { Relay } from './relay.js';
import { SessionManager } from './session-manager.js';
import { HeartbeatTicker } from './sse-writer.js';
import { RedisTokenLog } from './token-log-reader.js';
import { TokenizerCache } from './tokenizer-cache.js';
import { WorkerRegistry } from './worker-registry.js';

export interface RunningGateway {
  /** `http://host:port` the server listens on. */
  url: string;
  /**
   * Graceful stop: `/readyz` turns 503; new requests are still taken for `drainDelayMs`, then refused
   * (503 `shutting_down`); open streams get `drainTimeoutMs` more to finish, the rest end with an error frame.
   */
  drain(): Promise<void>;
  /** Whether `/readyz` would answer 200 now (read at each scrape: `sluice_gateway_ready`). */
  ready(): Promise<boolean>;
}

export interface StartGatewayOptions {
  /** Observability seams on the request path (metrics). */
  hooks?: GatewayHooks;
  /** Adds routes (e.g. `GET /metrics`) to the app before it serves. */
  configureApp?: (app: ReturnType<typeof createApp>) => void;
  /** Per-key usage (metrics). */
  keyUsage?: KeyUsageRecorder;
  /** Resolves at the next scrape of `/metrics` within `maxMs` (FINAL_SCRAPE_MAX_MS): awaited once the drain is done. */
  nextScrape?: (maxMs: number) => Promise<void>;
}

/** Redis did not answer at start (unreachable, a wrong password): the cause without the URL's password. */
export class RedisConnectError extends Error {
  override name = 'RedisConnectError';
  constructor(redisUrl: string, cause: Error) {
    super(`gateway cannot connect to Redis at ${redactRedisUrl(redisUrl)}: ${cause.message}`, { cause });
  }
}

/** The HTTP server could not listen on HOST:PORT (a port in use, an address this host does not have). */
export class ListenError extends Error {
  override name = 'ListenError';
  constructor(host: string, port: number, cause: NodeJS.ErrnoException) {
    const reason =
      cause.code === 'EADDRINUSE'
        ? 'the port is already in use'
        : cause.code === 'EADDRNOTAVAIL'
          ? 'HOST is not an address of this machine'
          : cause.message;
    super(`gateway cannot listen on HOST=${host} PORT=${port}: ${reason}${cause.code === undefined ? '' : ` (${cause.code})`}`, { cause });
  }
}

/** Longest wait between two reconnect attempts to Redis. */
const RECONNECT_MAX_MS = 250;
/** Redis unreachable this long (not a mere reconnect): the open streams end with an error. */
const REDIS_OUTAGE_MS = 2_000;

/** Connects to Redis, subscribes to this gateway's channel, reads the registry once, then listens. */
export async function startGateway(config: GatewayConfig, logger: Logger, options: StartGatewayOptions = {}): Promise<RunningGateway> {
  const hooks = options.hooks ?? {};
  const names = redisNames(config.redisPrefix);
  // One channel per process, not per GATEWAY_ID: a gateway restarted under the same id (docker-compose's
  // fixed ids) received its predecessor's entries and refreshed the alive key of that channel, so the
  // dead process's streams were never seen as a dead gateway's and decoded unseen to max_tokens.
  const channel = names.gatewayChannel(`${config.gatewayId}.${randomBytes(4).toString('hex')}`);
  // Commands fail fast while Redis is away (the request gets a 503) instead of queueing forever, and
  // every connection retries every ≤ 250 ms: ioredis's default backoff grows to 2 s, so a gateway
  // could stay unready for seconds after Redis returned.
  const retryStrategy = (times: number) => Math.min(50 * times, RECONNECT_MAX_MS);
  const redis = new Redis(config.redisUrl, { maxRetriesPerRequest: 1, enableOfflineQueue: false, lazyConnect: true, retryStrategy });
  const subscriber = new Redis(config.redisUrl, { maxRetriesPerRequest: null, lazyConnect: true, retryStrategy });
  const queueConnection = new Redis(config.redisUrl, {
    maxRetriesPerRequest: 1,
    enableOfflineQueue: false,
    lazyConnect: true,
    retryStrategy,
  });
  await connectRedis(
    [
      ['commands', redis],
      ['subscriber', subscriber],
      ['queue', queueConnection],
    ],
    (err, connection) => logger.warn({ err, connection }, 'redis connection error'),
  ).catch((cause: Error) => {
    throw new RedisConnectError(config.redisUrl, cause);
  });
  // Before anything listens: a gateway that must not start (public HOST, no key) stops here.
  const access = await startAccessControl(config, redis, logger, options.keyUsage ?? noKeyUsage).catch(async (error: unknown) => {
    await Promise.allSettled([redis.quit(), subscriber.quit(), queueConnection.quit()]);
    throw error;
  });

  const queue = new Queue(GENERATE_QUEUE, { connection: queueConnection, prefix: names.bullPrefix });
  queue.on('error', (err: Error) => logger.warn({ err: err.message }, 'queue error'));
  // The queue's own connection: a request's meta and its job then reach Redis in order, in one round trip.
  const jobs = new RedisJobQueue(queue, queueConnection, names, channel, config.streamRetentionMs, config.maxMigrations, logger);
  const log = new RedisTokenLog(redis, names);
  const sessions = new SessionManager(
    { queueTimeoutMs: config.queueTimeoutMs, idleTimeoutMs: config.idleTimeoutMs },
    jobs,
    log,
    logger,
    (gap) => hooks.streamGap?.(gap),
    (byThisGateway) => hooks.streamMigrated?.(byThisGateway),
  );
  // A revoked key's requests in flight end here: at its announcement, or at the next registry poll
  // for a gateway that missed it.
  const revocation = access.store === undefined ? undefined : new KeyRevocation(access.store, sessions, jobs, logger);
  const relay = new Relay(
    subscriber,
    channel,
    names.gatewaysChannel,
    {
      message: (message) => sessions.dispatch(message),
      broadcast: (message) => {
        if (message.type === 'key-revoked') revocation?.revoked(message.keyHash);
        else if (message.type === 'attempt-moved') sessions.attemptMoved(message.requestId, message.attempt);
        else if (message.channel !== channel) sessions.routeMovedAway(message.requestId);
      },
      // A subscriber that reconnected missed what was published meanwhile: the token logs have the
      // entries, the key store the revokes.
      messagesLost: () => {
        sessions.repairAll();
        void revocation?.check();
      },
    },
    logger,
  );
  await relay.start();
  // While Redis is away no entry can reach this gateway, and workers end the streams they cannot write
  // (their entries are lost): a stream is ended here once the outage outlasts a reconnect, instead of
  // hanging until Redis returns or its idle timeout.
  let outageTimer: NodeJS.Timeout | undefined;
  subscriber.on('close', () => {
    outageTimer ??= setTimeout(() => {
      outageTimer = undefined;
      if (subscriber.status === 'ready' || sessions.size === 0 || phase === 'refusing') return;
      logger.warn({ open: sessions.size }, 'redis unreachable: ending the open streams');
      sessions.failAll(new GatewayError('stream_interrupted', { message: 'The gateway lost its connection to Redis.' }), 'stream_failed');
    }, REDIS_OUTAGE_MS);
    outageTimer.unref();
  });
  subscriber.on('ready', () => {
    clearTimeout(outageTimer);
    outageTimer = undefined;
  });
  // Workers whose publish reaches nobody check this key before they count this gateway's clients as gone.
  const aliveKey = names.gatewayAliveKey(channel);
  const aliveTtlMs = Math.max(3_000, config.registryPollMs * 3);
  const keepAlive = () =>
    redis.set(aliveKey, '1', 'PX', aliveTtlMs).catch((error: unknown) => logger.warn({ err: error }, 'gateway heartbeat failed'));
  await keepAlive();
  const aliveTimer = setInterval(() => void keepAlive(), Math.floor(aliveTtlMs / 3));
  aliveTimer.unref();
  const tokenizers = new TokenizerCache(redis, names, logger);
  /** Logs and counts (as migrations) the requests a look through the active jobs moved. */
  const reportMoves = (moving: Promise<number>, what: string, fields: Record<string, unknown> = {}): void => {
    moving.then(
      (moved) => {
        if (moved > 0) logger.warn({ ...fields, moved }, `moved ${what}`);
        for (let i = 0; i < moved; i++) hooks.streamMigrated?.(true);
      },
      (error: unknown) => logger.warn({ ...fields, err: error }, `moving ${what} failed`),
    );
  };
  const registry: WorkerRegistry = new WorkerRegistry(redis, names, config.registryPollMs, logger, (live, takenAt, lost) => {
    sessions.failLostWorkers(live, takenAt);
    void revocation?.check();
    if (lost.length > 0) {
      const lostIds = lost.map((record) => record.workerId);
      reportMoves(
        jobs.recoverLost(lost, (requestId) => sessions.has(requestId)),
        'requests of lost workers',
        { lost: lostIds },
      );
    }
    // A model card is loaded when first named, not by the first request that needs it.
    for (const model of registry.models()) if (model.modelCard !== undefined) tokenizers.prefetch(model.modelCard);
  });
  await registry.refresh();
  registry.start();
  // Workers that were gone before this first read are in no read's lost records: found by their jobs.
  reportMoves(
    jobs.recoverOrphans((requestId) => sessions.has(requestId), config.registryPollMs),
    'requests of workers lost before this gateway started',
  );
  // Back from an outage: read the registry now (the poll keeps its last good read while Redis is away).
  redis.on(
    'ready',
    () => void registry.refresh().catch((error: unknown) => logger.warn({ err: error }, 'reading the worker registry failed')),
  );
  const heartbeats = new HeartbeatTicker(config.heartbeatMs, config.clientStallTimeoutMs);

  let phase: DrainPhase = 'serving';
  const appDeps: AppDeps = {
    config,
    logger,
    channel,
    sessions,
    jobs,
    log,
    idempotency: new IdempotencyStore(redis, names),
    registry,
    tokenizers,
    heartbeats,
    hooks,
    access,
    drainPhase: () => phase,
    // Ready only when every connection a request needs is up: commands (meta, logs, registry), the
    // queue (enqueue) and the subscriber (the answers).
    checkRedis: async () => {
      const ping = async (connection: Redis) => {
        try {
          return (await connection.ping()) === 'PONG';
        } catch {
          return false;
        }
      };
      const [commands, queued] = await Promise.all([ping(redis), ping(queueConnection)]);
      return commands && queued && subscriber.status === 'ready';
    },
  };
  const app = createApp(appDeps);

  options.configureApp?.(app);
  const server = await new Promise<ServerType>((resolve, reject) => {
    const s = serve(
      {
        fetch: app.fetch,
        port: config.port,
        hostname: config.host,
        // Deliberate, not Node's defaults (a slow-header connection lived ~82 s): headers and body
        // within bounds, checked every second; idle keep-alive longer than a proxy's upstream idle
        // timeout (so the proxy, not we, closes first); a cap on connections per gateway.
        serverOptions: {
          headersTimeout: config.access.headersTimeoutMs,
          requestTimeout: config.access.httpRequestTimeoutMs,
          keepAliveTimeout: config.access.keepAliveTimeoutMs,
          connectionsCheckingInterval: 1000,
          // Node answers a missing Host with a bare 400 (no body, no clientError); the app refuses it
          // with an OpenAI error body instead.
          requireHostHeader: false,
        },
      },
      () => {
        s.off('error', onListenError);
        resolve(s);
      },
    );
    // A port in use or an address this host does not have: an error event, not a throw.
    const onListenError = (error: NodeJS.ErrnoException) => reject(new ListenError(config.host, config.port, error));
    s.once('error', onListenError);
    s.maxConnections = config.access.maxConnections;
  }).catch(async (error: unknown) => {
    // Nothing listens: release what was started, each step even when another fails.
    clearInterval(aliveTimer);
    await Promise.allSettled(
      [
        () => registry.stop(),
        () => heartbeats.close(),
        () => sessions.close(),
        () => redis.del(aliveKey),
        () => relay.close(),
        () => queue.close(),
        () => redis.quit(),
        () => queueConnection.quit(),
      ].map(async (step) => step()),
    );
    throw error;
  });
  // Requests Node's parser refuses get an OpenAI error body too.
  server.on('clientError', clientErrorHandler(logger, hooks));
  const { httpRequestOpened } = hooks;
  if (httpRequestOpened !== undefined) {
    // A response's 'close' comes once it is sent or its connection is gone, whichever is first.
    server.on('request', (_req: IncomingMessage, res: ServerResponse) => res.once('close', httpRequestOpened()));
  }
  const address = server.address() as AddressInfo;
  const host = config.host === '0.0.0.0' || config.host === '::' ? '127.0.0.1' : config.host;
  const url = `http://${host}:${address.port}`;
  logger.info({ url, gatewayId: config.gatewayId, channel, workers: registry.liveWorkerCount }, 'gateway listening');

  const drain = async (): Promise<void> => {
    if (phase !== 'serving') return;
    phase = 'unready';
    const { drainDelayMs, drainTimeoutMs } = config;
    logger.info({ open: sessions.size, drainDelayMs, drainTimeoutMs }, 'draining');
    // Unready but still taking new requests while the load balancers notice.
    if (drainDelayMs > 0) await new Promise((resolve) => setTimeout(resolve, drainDelayMs));
    phase = 'refusing';
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([sessions.whenEmpty(), new Promise<void>((resolve) => (timer = setTimeout(resolve, config.drainTimeoutMs)))]);
    clearTimeout(timer);
    if (sessions.size > 0) {
      logger.warn(
        { open: sessions.size },
        'drain timeout: ending the remaining streams (those with a resume grace go on for a resume elsewhere)',
      );
      sessions.shutDown(new GatewayError('shutting_down'));
    }
    // The drained streams' outcomes are counted: one more scrape reads them before the process goes.
    if (options.nextScrape !== undefined && config.finalScrapeMaxMs > 0) {
      logger.info({ maxMs: config.finalScrapeMaxMs }, 'waiting for a last scrape of /metrics');
      await options.nextScrape(config.finalScrapeMaxMs);
    }
    // Each cleanup runs even when another fails.
    const steps: Array<[string, () => unknown]> = [
      [
        'http server',
        () =>
          new Promise<void>((resolve) => {
            // Streams are over; what is left is keep-alive connections (a scraper's, a proxy's), which
            // Node keeps serving after close(): one that sends its next request before it idles out
            // (Prometheus every few seconds) kept the gateway from ever stopping. Each is closed the
            // moment it is idle, and after 5 s whatever is left.
            // (serve() makes a node:http server: no http2 or https options are passed.)
            const http1 = server as HttpServer;
            const sweep = setInterval(() => http1.closeIdleConnections(), 100);
            const cut = setTimeout(() => http1.closeAllConnections(), 5_000);
            http1.close(() => {
              clearInterval(sweep);
              clearTimeout(cut);
              resolve();
            });
            http1.closeIdleConnections();
          }),
      ],
      ['registry', () => registry.stop()],
      [
        'alive key',
        async () => {
          clearInterval(aliveTimer);
          await redis.del(aliveKey);
        },
      ],
      ['sessions', () => sessions.close()],
      ['heartbeats', () => heartbeats.close()],
      // Let the cancels of failed streams go out before the connections close.
      ['cancels', () => new Promise((resolve) => setTimeout(resolve, 50))],
      [
        'relay',
        () => {
          clearTimeout(outageTimer);
          return relay.close();
        },
      ],
      ['queue', () => queue.close()],
      ['redis', () => redis.quit()],
      ['queue connection', () => queueConnection.quit()],
    ];
    for (const [name, step] of steps) {
      try {
        await step();
      } catch (error) {
        logger.warn({ err: error, step: name }, 'shutdown step failed');
      }
    }
    logger.info('gateway stopped');
  };

  return { url, drain, ready: async () => (await readiness(appDeps)).ready };
}
