import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { z } from 'zod';
import { DEFAULT_PREFIX, envInput, envInt as int, envMs as ms } from '@sluice/protocol';
import { accessEnvShape, toAccessConfig, type AccessConfig } from './auth/access-config.js';

/**
 * Every setting of the gateway, read from the environment once at start. An invalid value stops the
 * process with a message that names the variable.
 */
export const gatewayEnvSchema = z.object({
  /** HTTP port. @defaultValue 8080 */
  PORT: int(0, 65535).default(8080),
  /** HTTP listen address. @defaultValue 0.0.0.0 */
  HOST: z.string().min(1).default('0.0.0.0'),
  /** Redis for the queue, pub/sub and the worker registry. @defaultValue redis://127.0.0.1:6379 */
  REDIS_URL: z.url({ protocol: /^rediss?$/ }).default('redis://127.0.0.1:6379'),
  /** Prefix of every Sluice key and channel in Redis. @defaultValue sluice */
  REDIS_PREFIX: z.string().min(1).default(DEFAULT_PREFIX),
  /** This instance's id: its pub/sub channel name. Must be unique per running gateway. @defaultValue host-pid-random */
  GATEWAY_ID: z
    .string()
    .regex(/^[\w.-]+$/)
    .optional(),
  /** Max requests of this gateway waiting in the queue; beyond it, 429 with Retry-After. @defaultValue 1024 */
  MAX_QUEUED_REQUESTS: int(1).default(1024),
  /** Retry-After (seconds) sent with a 429 or 503. @defaultValue 1 */
  RETRY_AFTER_S: int(0).default(1),
  /** How long a streaming request may hold its 200 for the worker's accept/reject (0: at once). @defaultValue 0 */
  HEADERS_WAIT_MS: ms(0).default(0),
  /** SSE `: ping` comment after this long without any other write. @defaultValue 15000 */
  HEARTBEAT_MS: ms(10).default(15_000),
  /** Deltas of one stream arriving within this window are written as one chunk (0 = each as it comes). @defaultValue 0 */
  STREAM_INTERVAL_MS: ms(0).default(0),
  /** Most bytes one stream holds for a client that does not read (coalesced deltas + socket buffer); beyond, the stream ends and its work stops. @defaultValue 1048576 */
  MAX_STREAM_BUFFER_BYTES: int(0).default(1024 * 1024),
  /** A stream whose socket does not drain for this long ends and its work stops (0 = never). @defaultValue 30000 */
  CLIENT_STALL_TIMEOUT_MS: ms(0).default(30_000),
  /** Max time a request waits in the queue for a worker. @defaultValue 60000 */
  QUEUE_TIMEOUT_MS: ms(1).default(60_000),
  /** Max time without a delta once a worker accepted the request. @defaultValue 30000 */
  IDLE_TIMEOUT_MS: ms(1).default(30_000),
  /** Max total time of a request, queue included. @defaultValue 600000 */
  REQUEST_TIMEOUT_MS: ms(1).default(600_000),
  /** On SIGTERM: how long running streams may take to finish before they are ended with an error. @defaultValue 30000 */
  DRAIN_TIMEOUT_MS: ms(0).default(30_000),
  /**
   * On SIGTERM: how long the gateway still takes new requests while `/readyz` already answers 503, so
   * that a load balancer that does not retry a 503 stops sending it any before it refuses them (a
   * Kubernetes preStop sleep, built in). The drain's timeout counts after it. @defaultValue 0
   */
  DRAIN_DELAY_MS: ms(0).default(0),
  /**
   * On SIGTERM, once the drain is done: how long to wait at most for one more scrape of `/metrics`
   * (only when Prometheus scrapes at a steady pace: at most 2 × its interval + 5 s), so that the
   * counts of the last requests are read before the process and its series go. 0: no wait. @defaultValue 0
   */
  FINAL_SCRAPE_MAX_MS: ms(0).default(0),
  /** How often the worker registry is read (model list, liveness of the workers serving streams). @defaultValue 1000 */
  REGISTRY_POLL_MS: ms(50).default(1000),
  /** Max request body size in bytes (413 beyond). @defaultValue 4194304 */
  MAX_BODY_BYTES: int(1024).default(4 * 1024 * 1024),
  /** How long a request's token log stays readable after it ends: resume and gap repair. @defaultValue 600000 */
  STREAM_RETENTION_MS: ms(1000).default(600_000),
  /** Default `resume_grace_ms` of a streaming request (0: a client that leaves cancels its work at once). @defaultValue 0 */
  RESUME_GRACE_MS: ms(0).default(0),
  /** Cap on a request's `resume_grace_ms` (larger values are lowered to it). @defaultValue 600000 */
  MAX_RESUME_GRACE_MS: ms(0).default(600_000),
  /** How many times a stream may move to another worker after its worker was lost (then: `worker_lost`). @defaultValue 3 */
  MAX_MIGRATIONS: int(0).default(3),
  /** pino log level. @defaultValue info */
  LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
  /** Access control, input ceilings, connection limits: auth/access-config.ts. */
  ...accessEnvShape,
});

export type GatewayEnv = z.infer<typeof gatewayEnvSchema>;

export interface GatewayConfig {
  port: number;
  host: string;
  redisUrl: string;
  redisPrefix: string;
  gatewayId: string;
  maxQueuedRequests: number;
  retryAfterS: number;
  headersWaitMs: number;
  heartbeatMs: number;
  streamIntervalMs: number;
  maxStreamBufferBytes: number;
  clientStallTimeoutMs: number;
  queueTimeoutMs: number;
  idleTimeoutMs: number;
  requestTimeoutMs: number;
  drainTimeoutMs: number;
  drainDelayMs: number;
  finalScrapeMaxMs: number;
  registryPollMs: number;
  maxBodyBytes: number;
  streamRetentionMs: number;
  resumeGraceMs: number;
  maxResumeGraceMs: number;
  maxMigrations: number;
  logLevel: GatewayEnv['LOG_LEVEL'];
  access: AccessConfig;
}

/** Thrown for an invalid environment; the message names every bad variable. */
export class ConfigError extends Error {
  override name = 'ConfigError';
}

/** Reads and validates the environment. Empty and blank (whitespace-only) values count as unset. */
export function loadGatewayConfig(env: NodeJS.ProcessEnv = process.env): GatewayConfig {
  const input = envInput(env);
  const parsed = gatewayEnvSchema.safeParse(input);
  if (!parsed.success) {
    const lines = parsed.error.issues.map((issue) => `  ${issue.path.join('.')}: ${issue.message}`);
    throw new ConfigError(`invalid gateway configuration:\n${lines.join('\n')}`);
  }
  const e = parsed.data;
  return {
    port: e.PORT,
    host: e.HOST,
    redisUrl: e.REDIS_URL,
    redisPrefix: e.REDIS_PREFIX,
    gatewayId: e.GATEWAY_ID ?? `${hostname().replace(/[^\w.-]/g, '-')}-${process.pid}-${randomBytes(3).toString('hex')}`,
    maxQueuedRequests: e.MAX_QUEUED_REQUESTS,
    retryAfterS: e.RETRY_AFTER_S,
    headersWaitMs: e.HEADERS_WAIT_MS,
    heartbeatMs: e.HEARTBEAT_MS,
    streamIntervalMs: e.STREAM_INTERVAL_MS,
    maxStreamBufferBytes: e.MAX_STREAM_BUFFER_BYTES,
    clientStallTimeoutMs: e.CLIENT_STALL_TIMEOUT_MS,
    queueTimeoutMs: e.QUEUE_TIMEOUT_MS,
    idleTimeoutMs: e.IDLE_TIMEOUT_MS,
    requestTimeoutMs: e.REQUEST_TIMEOUT_MS,
    drainTimeoutMs: e.DRAIN_TIMEOUT_MS,
    drainDelayMs: e.DRAIN_DELAY_MS,
    finalScrapeMaxMs: e.FINAL_SCRAPE_MAX_MS,
    registryPollMs: e.REGISTRY_POLL_MS,
    maxBodyBytes: e.MAX_BODY_BYTES,
    streamRetentionMs: e.STREAM_RETENTION_MS,
    resumeGraceMs: e.RESUME_GRACE_MS,
    maxResumeGraceMs: e.MAX_RESUME_GRACE_MS,
    maxMigrations: e.MAX_MIGRATIONS,
    logLevel: e.LOG_LEVEL,
    access: toAccessConfig(e),
  };
}
