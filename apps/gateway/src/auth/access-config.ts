import { z } from 'zod';
import { envInt as int, envMs as ms } from '@sluice/protocol';

/**
 * The gateway settings of access control, input ceilings and the HTTP server's connection limits.
 * Spread into `gatewayEnvSchema` (config.ts) so that one schema names every variable.
 */
export const accessEnvShape = {
  /**
   * `keys`: every `/v1` request needs an API key; `none`: no key is checked. Unset: `keys` when an API
   * key exists in Redis (or API_KEY is set), else `none` on a loopback HOST; on any other HOST the
   * gateway refuses to start (like Redis's protected mode). @defaultValue unset
   */
  AUTH: z.enum(['keys', 'none']).optional(),
  /** An API key created (or kept) in Redis at start, e.g. from a Docker secret: at least 32 characters. @defaultValue unset */
  API_KEY: z.string().min(32).max(256).optional(),
  /** File holding API_KEY (a mounted secret); trailing whitespace is ignored. @defaultValue unset */
  API_KEY_FILE: z.string().min(1).optional(),
  /** Name of the key from API_KEY / API_KEY_FILE. @defaultValue default */
  API_KEY_NAME: z
    .string()
    .regex(/^[\w.-]{1,64}$/)
    .default('default'),
  /** Comma-separated origins allowed to call the API from a browser (`*`: any). Empty: no cross-origin access. @defaultValue unset */
  CORS_ORIGINS: z.string().optional(),
  /** Ceiling on `max_tokens` / `max_completion_tokens` (400 beyond; a model with a smaller context refuses earlier with context_length_exceeded). @defaultValue 131072 */
  MAX_TOKENS_LIMIT: int(1).default(131_072),
  /** Max stop strings per request. @defaultValue 4 */
  MAX_STOP_SEQUENCES: int(0).default(4),
  /** Max characters of one stop string. @defaultValue 256 */
  MAX_STOP_LENGTH: int(1).default(256),
  /** Max messages of a chat request. @defaultValue 1024 */
  MAX_MESSAGES: int(1).default(1024),
  /** Max `n` (choices per request). @defaultValue 8 */
  MAX_N: int(1).default(8),
  /** Max characters of `user` and of a message's `name`. @defaultValue 256 */
  MAX_USER_LENGTH: int(1).default(256),
  /** Node `server.headersTimeout`: a client gets this long to send its request headers (408 after). @defaultValue 10000 */
  HEADERS_TIMEOUT_MS: ms(1).default(10_000),
  /** Node `server.requestTimeout`: a client gets this long to send its whole request (headers + body; not the reply). @defaultValue 30000 */
  HTTP_REQUEST_TIMEOUT_MS: ms(1).default(30_000),
  /** Node `server.keepAliveTimeout`: an idle keep-alive connection closes after this long; longer than the proxy's upstream idle timeout. @defaultValue 65000 */
  KEEP_ALIVE_TIMEOUT_MS: ms(0).default(65_000),
  /** Node `server.maxConnections`: open connections per gateway; beyond it new ones are dropped. @defaultValue 4096 */
  MAX_CONNECTIONS: int(1).default(4096),
  /** Distinct key names given their own `key` label in the per-key metrics; the rest count as `other`. @defaultValue 100 */
  METRICS_MAX_KEYS: int(0).default(100),
};

type AccessEnv = z.infer<z.ZodObject<typeof accessEnvShape>>;

export interface AccessConfig {
  /** Unset: decided at start (see AUTH). */
  auth: 'keys' | 'none' | undefined;
  apiKey: string | undefined;
  apiKeyFile: string | undefined;
  apiKeyName: string;
  /** Allowed browser origins; `['*']` allows any. */
  corsOrigins: string[];
  maxTokensLimit: number;
  maxStopSequences: number;
  maxStopLength: number;
  maxMessages: number;
  maxN: number;
  maxUserLength: number;
  headersTimeoutMs: number;
  httpRequestTimeoutMs: number;
  keepAliveTimeoutMs: number;
  maxConnections: number;
  metricsMaxKeys: number;
}

export function toAccessConfig(e: AccessEnv): AccessConfig {
  return {
    auth: e.AUTH,
    apiKey: e.API_KEY,
    apiKeyFile: e.API_KEY_FILE,
    apiKeyName: e.API_KEY_NAME,
    corsOrigins: (e.CORS_ORIGINS ?? '')
      .split(',')
      .map((origin) => origin.trim())
      .filter((origin) => origin !== ''),
    maxTokensLimit: e.MAX_TOKENS_LIMIT,
    maxStopSequences: e.MAX_STOP_SEQUENCES,
    maxStopLength: e.MAX_STOP_LENGTH,
    maxMessages: e.MAX_MESSAGES,
    maxN: e.MAX_N,
    maxUserLength: e.MAX_USER_LENGTH,
    // Node refuses a headersTimeout above requestTimeout.
    headersTimeoutMs: Math.min(e.HEADERS_TIMEOUT_MS, e.HTTP_REQUEST_TIMEOUT_MS),
    httpRequestTimeoutMs: e.HTTP_REQUEST_TIMEOUT_MS,
    keepAliveTimeoutMs: e.KEEP_ALIVE_TIMEOUT_MS,
    maxConnections: e.MAX_CONNECTIONS,
    metricsMaxKeys: e.METRICS_MAX_KEYS,
  };
}
