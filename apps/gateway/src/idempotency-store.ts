import { createHash } from 'node:crypto';
import type { Redis } from 'ioredis';
import type { RedisNames } from '@sluice/protocol';
import type { Endpoint } from './openai/request-schemas.js';

/** A record this request holds: the key is free for it to admit under (`value`: what the record says). */
export interface ClaimedKey {
  kind: 'claimed';
  key: string;
  value: string;
}

/** A record another request holds. */
export interface TakenKey {
  kind: 'taken';
  key: string;
  /** The record as read: a reclaim replaces only this. */
  value: string;
  jobId: string;
  /** Same route and body as the request that holds it. */
  sameRequest: boolean;
  /** Its request was enqueued (a record without `kept` is a claim still being admitted, or one whose gateway died). */
  kept: boolean;
}

export type IdempotencyClaim = ClaimedKey | TakenKey;

/**
 * How long a claim lives before its request is enqueued: a gateway that dies between the claim and the
 * enqueue leaves a key that names nothing, and a retry with it is answered 409 until the claim lapses.
 * Once the job is enqueued the claim is kept at least as long as the request's meta.
 */
export const CLAIM_TTL_MS = 30_000;

/**
 * `Idempotency-Key` records: one per key (scoped to the API key that sent it), naming the request it
 * admitted and a digest of that request's body (`<job id> <digest>`, then ` kept` once the job is
 * enqueued). A POST that comes again with the same key (nginx's `proxy_next_upstream` after the gateway
 * it first reached died; a client's own retry) is delivered the request already running or finished
 * instead of generating and charging it a second time.
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
    const value = `${jobId} ${digest}`;
    const previous = await this.redis.set(recordKey, value, 'PX', CLAIM_TTL_MS, 'NX', 'GET');
    if (previous === null) return { kind: 'claimed', key: recordKey, value };
    const [takenBy = '', takenDigest, state] = previous.split(' ');
    return { kind: 'taken', key: recordKey, value: previous, jobId: takenBy, sameRequest: takenDigest === digest, kept: state === 'kept' };
  }

  /**
   * Takes over a record whose request left no answer to deliver (it failed, was cancelled, or its meta
   * expired) for the request `jobId`, unless another request replaced it since it was read.
   * @returns the claim, or undefined when the record changed meanwhile
   */
  async reclaim(taken: TakenKey, jobId: string): Promise<ClaimedKey | undefined> {
    const value = `${jobId} ${taken.value.split(' ')[1] ?? ''}`;
    const swapped = await this.redis.eval(RECLAIM_SCRIPT, 1, taken.key, taken.value, value, CLAIM_TTL_MS);
    return swapped === 1 ? { kind: 'claimed', key: taken.key, value } : undefined;
  }

  /** The claimed request was enqueued: its record lives as long as its meta at least (`ttlMs`). */
  async keep(claim: ClaimedKey, ttlMs: number): Promise<void> {
    await this.redis.set(claim.key, `${claim.value} kept`, 'PX', ttlMs);
  }

  /** The claimed request was refused before it was enqueued: the key is free for a retry. */
  async release(claim: ClaimedKey): Promise<void> {
    await this.redis.del(claim.key);
  }

  private recordKey(owner: string, key: string): string {
    // Hashed: the key is the client's string (up to 255 characters), and the owner part keeps one API
    // key's records out of another's reach.
    return this.names.idempotencyKey(createHash('sha256').update(`${owner}\n${key}`).digest('base64url'));
  }
}

/** Replaces the record only if it still says what was read (ARGV[1]): a compare-and-set. */
const RECLAIM_SCRIPT = `
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
`;

/** The route and the body, as parsed (a retry through a proxy sends the same bytes, so the same JSON). */
function bodyDigest(endpoint: Endpoint, body: unknown): string {
  return createHash('sha256')
    .update(`${endpoint}\n${JSON.stringify(body)}`)
    .digest('base64url');
}

/** A usable `Idempotency-Key`: 1–255 visible ASCII characters (what the IETF draft and Stripe allow). */
export const IDEMPOTENCY_KEY_PATTERN = /^[\x21-\x7e]{1,255}$/;
