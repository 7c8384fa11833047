import type { MiddlewareHandler } from 'hono';
import type { AppEnv } from '../app.js';
import { GatewayError } from '../errors.js';
import { credentialFrom, hashApiKey } from './api-key.js';
import type { ApiKeyStore } from './api-key-store.js';
import type { ApiKeyRecord } from './api-key.js';
import type { KeyUsageRecorder } from './key-usage-recorder.js';

/** The key a request was authenticated with, for admission (limits, models) and metrics. */
export interface AuthenticatedKey {
  /** sha256 of the key: its id in Redis. */
  hash: string;
  record: ApiKeyRecord;
}

/** Longest header value worth hashing; anything longer cannot be an issued key. */
const MAX_KEY_LENGTH = 256;

/**
 * Requires a valid API key (`Authorization: Bearer` or `x-api-key`) on every route it guards: 401
 * with the OpenAI error body otherwise. The key is looked up in Redis on every request, so a key
 * revoked on one gateway is refused by all at once. CORS preflights never carry credentials and pass.
 */
export function authMiddleware(store: ApiKeyStore, usage: KeyUsageRecorder): MiddlewareHandler<AppEnv> {
  return async (c, next) => {
    if (c.req.method === 'OPTIONS') return next();
    const key = credentialFrom(c.req.header('authorization'), c.req.header('x-api-key'));
    if (key === undefined) {
      usage.authFailed('missing');
      throw new GatewayError('invalid_api_key', {
        message: 'No API key: send it as "Authorization: Bearer <key>" (or "x-api-key: <key>").',
      });
    }
    let record: ApiKeyRecord | undefined;
    if (key.length <= MAX_KEY_LENGTH) {
      try {
        record = await store.find(key);
      } catch (error) {
        throw new GatewayError('store_unavailable', { message: 'The key store is unavailable.', cause: error });
      }
    }
    if (record === undefined) {
      usage.authFailed('invalid');
      throw new GatewayError('invalid_api_key', { message: 'Invalid API key.' });
    }
    c.set('apiKey', { hash: hashApiKey(key), record } satisfies AuthenticatedKey);
    return next();
  };
}
