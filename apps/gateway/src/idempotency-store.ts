import { createHash } from 'node:crypto';
import type { Redis } from 'ioredis';
import type { RedisNames } from '@sluice/protocol';
import type { Endpoint } from './openai/request-schemas.js';

/**
 * What a claim of an idempotency key found: the key was free and now names this request (`claimed`),
 * or it already names another request, made with the same body or not.
 */
export type IdempotencyClaim = { kind: 'claimed'; key: string } | { kind: 'taken'; jobId: string; sameRequest: boolean };

/**
 * How long a claim lives before its request is enqueued: a gateway that dies between the claim and the
 * enqueue leaves a key that names nothing, and a retry with it is answered 409 until the claim lapses.
 * Once the job is enqueued the claim is kept as long as the request's meta.
 */
export const CLAIM_TTL_MS = 30_000;

/**
 * `Idempotency-Key` records: one per key (scoped to the API key that sent it), naming the request it
 * admitted and a digest of that request's body. A POST that comes again with the same key (nginx's
 * `proxy_next_upstream` after the gateway it first reached died; a client's own retry) is delivered the
 * request already running or finished instead of generating and charging it a second time.
 */
export class IdempotencyStore {
  constructor(
    private readonly redis: Redis,
    private readonly names: RedisNames,
  ) {}

  /**
   * Claims `key` for the request `jobId` unless it names one already (one round trip: SET NX GET).
   * @param owner the hash of the API key that sent it ('' on a gateway without keys)
   * @param body the parsed body: with the route it makes the digest that tells a retry from a reuse
   */
  async claim(owner: string, key: string, endpoint: Endpoint, body: unknown, jobId: string): Promise<IdempotencyClaim> {
    const recordKey = this.recordKey(owner, key);
    const digest = bodyDigest(endpoint, body);
    const previous = await this.redis.set(recordKey, `${jobId} ${digest}`, 'PX', CLAIM_TTL_MS, 'NX', 'GET');
    if (previous === null) return { kind: 'claimed', key: recordKey };
    const [takenBy = '', takenDigest] = previous.split(' ');
    return { kind: 'taken', jobId: takenBy, sameRequest: takenDigest === digest };
  }

  /** The claimed request was enqueued: its record lives as long as its meta (`ttlMs`). */
  async keep(claim: { key: string }, ttlMs: number): Promise<void> {
    await this.redis.pexpire(claim.key, ttlMs);
  }

  /** The claimed request was refused before it was enqueued: the key is free for a retry. */
  async release(claim: { key: string }): Promise<void> {
    await this.redis.del(claim.key);
  }

  private recordKey(owner: string, key: string): string {
    // Hashed: the key is the client's string (up to 255 characters), and the owner part keeps one API
    // key's records out of another's reach.
    return this.names.idempotencyKey(createHash('sha256').update(`${owner}\n${key}`).digest('base64url'));
  }
}

/** The route and the body, as parsed (a retry through a proxy sends the same bytes, so the same JSON). */
function bodyDigest(endpoint: Endpoint, body: unknown): string {
  return createHash('sha256')
    .update(`${endpoint}\n${JSON.stringify(body)}`)
    .digest('base64url');
}

/** A usable `Idempotency-Key`: 1–255 visible ASCII characters (what the IETF draft and Stripe allow). */
export const IDEMPOTENCY_KEY_PATTERN = /^[\x21-\x7e]{1,255}$/;
