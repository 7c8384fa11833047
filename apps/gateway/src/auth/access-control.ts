import { readFileSync } from 'node:fs';
import { isIPv4 } from 'node:net';
import type { MiddlewareHandler } from 'hono';
import type { Redis } from 'ioredis';
import { RequestScripts, redisNames } from '@sluice/protocol';
import type { Logger } from 'pino';
import type { AppEnv } from '../app.js';
import type { GatewayConfig } from '../config.js';
import { AccessConfigError } from './access-config-error.js';
import { ApiKeyStore } from './api-key-store.js';
import { authMiddleware } from './auth-middleware.js';
import { KeyAdmission } from './key-admission.js';
import type { KeyUsageRecorder } from './key-usage-recorder.js';
import { RateLimiter } from './rate-limiter.js';

/** What the app uses of access control; both absent with AUTH=none. */
export interface AccessControl {
  readonly mode: 'keys' | 'none';
  /** Guards `/v1/*`: 401 without a valid key. */
  readonly authenticate?: MiddlewareHandler<AppEnv>;
  /** Allowed models and per-key limits of each generation request. */
  readonly admission?: KeyAdmission;
  /** The keys: a revoked key's requests in flight are ended (key-revocation.ts). */
  readonly store?: ApiKeyStore;
}

/** Whether HOST only accepts connections from this machine. */
export function isLoopbackHost(host: string): boolean {
  const h = host.replace(/^\[|\]$/g, '').toLowerCase();
  return h === 'localhost' || h === '::1' || (isIPv4(h) && h.startsWith('127.'));
}

function readApiKey(config: GatewayConfig): string | undefined {
  const { apiKey, apiKeyFile } = config.access;
  if (apiKey !== undefined) return apiKey;
  if (apiKeyFile === undefined) return undefined;
  let key: string;
  try {
    key = readFileSync(apiKeyFile, 'utf8').trim();
  } catch (error) {
    throw new AccessConfigError(`API_KEY_FILE=${apiKeyFile} cannot be read: ${(error as Error).message}`);
  }
  if (key.length < 32 || key.length > 256 || /\s/.test(key)) {
    throw new AccessConfigError(`API_KEY_FILE=${apiKeyFile} must hold one key of 32 to 256 characters without spaces`);
  }
  return key;
}

/** The Redis server's `run_id`: a new one for every start of the server. */
async function redisRunId(redis: Redis): Promise<string | undefined> {
  return /run_id:(\w+)/.exec(await redis.info('server'))?.[1];
}

/**
 * A Redis that restarted without its data (no persistence) forgot the API_KEY stored at start, and
 * every request was a 401 until the gateways restarted: it is stored again when the connection comes
 * back to a Redis server that was restarted (a new `run_id`). A reconnect to the same server stores
 * nothing, so a key revoked there stays revoked.
 */
function storeAgainAfterRedisRestarts(redis: Redis, runId: string | undefined, store: () => Promise<void>, logger: Logger): void {
  let seen = runId;
  redis.on('ready', () => {
    redisRunId(redis)
      .then(async (current) => {
        if (current === seen) return;
        seen = current;
        await store();
        logger.warn('Redis was restarted: the API key from API_KEY is stored again');
      })
      .catch((error: unknown) => logger.warn({ err: error }, 'storing the API key from API_KEY again failed'));
  });
}

/**
 * Decides how this gateway checks keys, at start, like Redis's protected mode:
 * - AUTH=keys: keys required (a warning when none exists yet: every request gets 401 until one is created).
 * - AUTH=none: no key checked, anywhere (logged as a warning when HOST is not loopback).
 * - AUTH unset: keys when any key exists (or API_KEY is set); else no keys on a loopback HOST (logged),
 *   and a refusal to start on any other HOST.
 * API_KEY / API_KEY_FILE is stored (idempotently) under API_KEY_NAME first.
 */
export async function startAccessControl(
  config: GatewayConfig,
  redis: Redis,
  logger: Logger,
  usage: KeyUsageRecorder,
): Promise<AccessControl> {
  const store = new ApiKeyStore(redis, config.redisPrefix);
  const bootstrapKey = readApiKey(config);
  if (bootstrapKey !== undefined) {
    await store.add(bootstrapKey, config.access.apiKeyName);
    logger.info({ key: config.access.apiKeyName }, 'API key from API_KEY stored');
    storeAgainAfterRedisRestarts(redis, await redisRunId(redis), () => store.add(bootstrapKey, config.access.apiKeyName), logger);
  }
  const keys = await store.count();
  const loopback = isLoopbackHost(config.host);
  let mode = config.access.auth;
  if (mode === undefined) {
    if (keys > 0) mode = 'keys';
    else if (loopback) {
      mode = 'none';
      logger.warn(
        { host: config.host },
        'AUTH=none: no API key exists and HOST is loopback, so requests need no key (create one with `npm run keys -- create --name <name>`, or set AUTH=keys)',
      );
    } else {
      throw new AccessConfigError(
        `refusing to start: HOST=${config.host} is not a loopback address and no API key exists, so anyone who reaches this port could use it.\n` +
          '  Create a key (`npm run keys -- create --name <name>`, or set API_KEY / API_KEY_FILE), or set AUTH=none to serve without keys,\n' +
          '  or bind to a loopback address (HOST=127.0.0.1).',
      );
    }
  } else if (mode === 'none') {
    (loopback ? logger.info.bind(logger) : logger.warn.bind(logger))({ host: config.host }, 'AUTH=none: requests need no API key');
  } else if (keys === 0) {
    logger.warn(
      'AUTH=keys but no API key exists yet: every request gets 401 until one is created (`npm run keys -- create --name <name>`)',
    );
  }
  if (mode === 'none') return { mode };
  logger.info({ keys }, 'AUTH=keys: every /v1 request needs an API key');
  const limiter = new RateLimiter(redis, config.redisPrefix);
  // A stream slot outlives a gateway that died holding it by at most the request deadline.
  const leaseMs = config.requestTimeoutMs + 10_000;
  return {
    mode,
    authenticate: authMiddleware(store, usage),
    store,
    admission: new KeyAdmission(limiter, usage, logger, leaseMs, new RequestScripts(redis, redisNames(config.redisPrefix))),
  };
}
