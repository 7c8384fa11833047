import { createHash, randomBytes } from 'node:crypto';
import { z } from 'zod';

/**
 * An API key and its stored record. Keys are 256 random bits, so one unsalted SHA-256 is enough to
 * store them (no dictionary to try); Redis holds only the hash, and a key is shown once, at creation.
 */

/** Every issued key starts with this, so a leaked one is recognisable in logs and secret scanners. */
export const API_KEY_PREFIX = 'sk-sluice-';
/** Key names: the `key` label of the per-key metrics, so kept short and plain. */
export const KEY_NAME_PATTERN = /^[\w.-]{1,64}$/;

export const apiKeyLimitsSchema = z.object({
  /** Requests per minute (sliding 60 s window). */
  rpm: z.number().int().positive().optional(),
  /** Prompt + completion tokens per minute (reserved at admission, settled at the end). */
  tpm: z.number().int().positive().optional(),
  /** Generations in flight at once. */
  maxStreams: z.number().int().positive().optional(),
});
export type ApiKeyLimits = z.infer<typeof apiKeyLimitsSchema>;

/** What Redis stores per key (JSON), under the key's hash. */
export const apiKeyRecordSchema = z.object({
  name: z.string().regex(KEY_NAME_PATTERN),
  limits: apiKeyLimitsSchema,
  /** Model ids this key may use; absent: every model. */
  models: z.array(z.string().min(1)).optional(),
  /** ms since epoch. */
  createdAt: z.number(),
});
export type ApiKeyRecord = z.infer<typeof apiKeyRecordSchema>;

export function generateApiKey(): string {
  return API_KEY_PREFIX + randomBytes(32).toString('base64url');
}

/** Hex SHA-256 of the key: its id in Redis. */
export function hashApiKey(key: string): string {
  return createHash('sha256').update(key, 'utf8').digest('hex');
}

/**
 * The key a request presents: `Authorization: Bearer <key>` (what the OpenAI clients send), else
 * `x-api-key`. Undefined when neither carries one.
 */
export function credentialFrom(authorization: string | undefined, xApiKey: string | undefined): string | undefined {
  if (authorization !== undefined) {
    const match = /^Bearer[ \t]+(\S+)[ \t]*$/i.exec(authorization);
    if (match?.[1] !== undefined) return match[1];
  }
  const key = xApiKey?.trim();
  return key === undefined || key === '' ? undefined : key;
}
