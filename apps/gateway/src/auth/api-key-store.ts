import type { Redis } from 'ioredis';
import { encodeGatewayBroadcast, redisNames } from '@sluice/protocol';
import { apiKeyRecordSchema, generateApiKey, hashApiKey, KEY_NAME_PATTERN, type ApiKeyLimits, type ApiKeyRecord } from './api-key.js';

/** A stored key as `list` shows it: never the key, only its record and a short hash prefix. */
export interface ApiKeyListing extends ApiKeyRecord {
  hashPrefix: string;
}

export class ApiKeyStoreError extends Error {
  override name = 'ApiKeyStoreError';
}

/**
 * API keys in Redis, shared by every gateway: `<prefix>:apikeys` maps sha256(key) → record (JSON),
 * `<prefix>:apikey-names` maps name → hash (names are unique, so `revoke --name` is unambiguous).
 * A revoked key is gone from the hash at once, so the next request on any gateway gets 401, and the
 * revoke is announced to every gateway, which ends the key's requests in flight.
 */
export class ApiKeyStore {
  readonly #redis: Redis;
  readonly #records: string;
  readonly #names: string;
  readonly #gateways: string;

  constructor(redis: Redis, prefix: string) {
    this.#redis = redis;
    this.#records = `${prefix}:apikeys`;
    this.#names = `${prefix}:apikey-names`;
    this.#gateways = redisNames(prefix).gatewaysChannel;
  }

  /** Creates a key and returns it: the only time it is ever seen. */
  async create(name: string, limits: ApiKeyLimits = {}, models?: string[]): Promise<string> {
    const key = generateApiKey();
    await this.add(key, name, limits, models);
    return key;
  }

  /**
   * Stores a given key under `name` (API_KEY at start). Idempotent for the same key and name; a name
   * held by another key is refused.
   */
  async add(key: string, name: string, limits: ApiKeyLimits = {}, models?: string[]): Promise<void> {
    if (!KEY_NAME_PATTERN.test(name)) throw new ApiKeyStoreError(`invalid key name "${name}": use 1-64 of [A-Za-z0-9_.-]`);
    const hash = hashApiKey(key);
    const record: ApiKeyRecord = apiKeyRecordSchema.parse({
      name,
      limits,
      ...(models === undefined ? {} : { models }),
      createdAt: Date.now(),
    });
    // Name and record together, or neither: a name taken by another key refuses the whole write.
    const result = (await this.#redis.eval(
      `local held = redis.call('HGET', KEYS[2], ARGV[1])
       if held and held ~= ARGV[2] then return 0 end
       if not held then
         redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
         redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
       end
       return 1`,
      2,
      this.#records,
      this.#names,
      name,
      hash,
      JSON.stringify(record),
    )) as number;
    if (result !== 1) throw new ApiKeyStoreError(`a key named "${name}" exists already`);
  }

  /** The record of a presented key, or undefined when no such key was issued (or it was revoked). */
  async find(key: string): Promise<ApiKeyRecord | undefined> {
    const raw = await this.#redis.hget(this.#records, hashApiKey(key));
    if (raw === null) return undefined;
    try {
      const parsed = apiKeyRecordSchema.safeParse(JSON.parse(raw));
      return parsed.success ? parsed.data : undefined;
    } catch {
      return undefined;
    }
  }

  async list(): Promise<ApiKeyListing[]> {
    const all = await this.#redis.hgetall(this.#records);
    const out: ApiKeyListing[] = [];
    for (const [hash, raw] of Object.entries(all)) {
      try {
        const parsed = apiKeyRecordSchema.safeParse(JSON.parse(raw));
        if (parsed.success) out.push({ ...parsed.data, hashPrefix: hash.slice(0, 12) });
      } catch {
        // A foreign or corrupt entry is not a key.
      }
    }
    return out.sort((a, b) => a.name.localeCompare(b.name));
  }

  async count(): Promise<number> {
    return this.#redis.hlen(this.#records);
  }

  /**
   * The hashes among `hashes` that name no key any more (revoked), in one round trip. A hash whose
   * check failed is not among them: only a key known to be gone ends its requests.
   */
  async missing(hashes: readonly string[]): Promise<string[]> {
    if (hashes.length === 0) return [];
    const pipeline = this.#redis.pipeline();
    for (const hash of hashes) pipeline.hexists(this.#records, hash);
    const replies = (await pipeline.exec()) ?? [];
    return hashes.filter((_, i) => {
      const [error, exists] = replies[i] ?? [null, 1];
      return error === null && exists === 0;
    });
  }

  /**
   * Removes the key named `name` and announces it on the gateways' channel, in one step: every gateway
   * then ends the key's requests in flight (one that misses the message finds the key gone at its next
   * registry poll). False when there is no such key.
   */
  async revoke(name: string): Promise<boolean> {
    for (;;) {
      const hash = await this.#redis.hget(this.#names, name);
      if (hash === null) return false;
      // The message is encoded here, once; the script checks that the name still holds this hash (a
      // concurrent revoke and create of the same name reads it again).
      const removed = (await this.#redis.eval(
        `if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
         redis.call('HDEL', KEYS[2], ARGV[1])
         redis.call('HDEL', KEYS[1], ARGV[2])
         redis.call('PUBLISH', ARGV[3], ARGV[4])
         return 1`,
        2,
        this.#records,
        this.#names,
        name,
        hash,
        this.#gateways,
        encodeGatewayBroadcast({ type: 'key-revoked', keyHash: hash }),
      )) as number;
      if (removed === 1) return true;
    }
  }
}
