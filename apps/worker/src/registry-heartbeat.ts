import { setTimeout as sleep } from 'node:timers/promises';
import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import {
  decodeWorkerRecord,
  encodeModelCard,
  encodeWorkerRecord,
  modelCardHash,
  type ModelCard,
  type RedisNames,
  type WorkerRecord,
} from '@sluice/protocol';
import { StartupError } from './startup-error.js';

/** A model card outlives the last heartbeat that touched it by this long (gateways cache it anyway). */
const CARD_TTL_MS = 24 * 3600_000;

/**
 * Keeps this worker's registry record alive: a key with a TTL rewritten every `heartbeatMs`, plus an
 * entry in the workers index. A worker that dies stops heartbeating; gateways see its key expire.
 */
export class RegistryHeartbeat {
  private timer: NodeJS.Timeout | undefined;
  private readonly startedAt = Date.now();
  /** The last beat replaced another process's record under this id (said once per spell). */
  private foreignSeen = false;
  private readonly card: { hash: string; encoded: string } | undefined;

  constructor(
    private readonly redis: Redis,
    private readonly names: RedisNames,
    private readonly ttlMs: number,
    private readonly heartbeatMs: number,
    private readonly record: () => Omit<WorkerRecord, 'startedAt' | 'heartbeatAt'>,
    private readonly logger: Logger,
    /** The model card gateways tokenize with; written under its hash, named in every record. */
    card?: ModelCard,
  ) {
    if (card !== undefined) {
      const encoded = encodeModelCard(card);
      this.card = { hash: modelCardHash(encoded), encoded };
    }
  }

  async start(): Promise<void> {
    await this.claimId();
    // Before the first record names it: a gateway never sees a hash it cannot load.
    if (this.card !== undefined) await this.redis.set(this.names.modelCardKey(this.card.hash), this.card.encoded, 'PX', CARD_TTL_MS);
    await this.beat();
    this.timer = setInterval(() => {
      this.beat().catch((error: unknown) => this.logger.warn({ err: error }, 'registry heartbeat failed'));
    }, this.heartbeatMs);
  }

  /**
   * A record under this worker's id before its first beat is another process's: a worker that died
   * less than its TTL ago (a fast restart under a fixed WORKER_ID) — its record stops changing and
   * expires — or a live worker given the same WORKER_ID, which rewrites it every beat. Waits the first
   * out (gateways also tell a new process by its `startedAt`); refuses to start beside the second: two
   * processes under one id would each look like the other's restart to every gateway.
   */
  private async claimId(): Promise<void> {
    const key = this.names.workerKey(this.record().workerId);
    const replies = await this.redis.multi().get(key).pttl(key).exec();
    const first = replies?.[0]?.[1] as string | null | undefined;
    if (first === null || first === undefined) return;
    const ttlMs = Number(replies?.[1]?.[1] ?? 0);
    const until = Date.now() + Math.max(0, ttlMs);
    this.logger.warn({ waitMs: Math.max(0, ttlMs) }, 'a record under this WORKER_ID is still alive: waiting for it to expire');
    while (Date.now() < until) {
      await sleep(Math.max(1, Math.min(this.heartbeatMs, until - Date.now())));
      const now = await this.redis.get(key);
      if (now === null) return;
      if (now !== first) {
        throw new StartupError(
          `found WORKER_ID=${this.record().workerId} in use by a live worker`,
          'give each worker its own id, or leave WORKER_ID unset',
        );
      }
    }
  }

  async beat(): Promise<void> {
    const now = Date.now();
    const card = this.card;
    const record: WorkerRecord = {
      ...this.record(),
      startedAt: this.startedAt,
      heartbeatAt: now,
      ...(card === undefined ? {} : { modelCard: card.hash }),
    };
    const multi = this.redis.multi();
    // The card goes first, so a gateway that reads the record finds it. A beat only refreshes its TTL
    // (megabytes are not resent every second); a Redis that lost it (a restart) gets it again.
    if (card !== undefined) multi.pexpire(this.names.modelCardKey(card.hash), CARD_TTL_MS);
    const results = await multi
      .set(this.names.workerKey(record.workerId), encodeWorkerRecord(record), 'PX', this.ttlMs, 'GET')
      .zadd(this.names.workersIndexKey, String(now), record.workerId)
      .exec();
    if (card !== undefined && results?.[0]?.[1] !== 1) {
      await this.redis.set(this.names.modelCardKey(card.hash), card.encoded, 'PX', CARD_TTL_MS);
    }
    // The record this beat replaced: another process's, when a worker with the same WORKER_ID started
    // after this one's check (or thawed after this one took its id over). Said once, loudly: gateways
    // take each of the two for the other's restart, and move their streams at every read.
    const previous = results?.[card === undefined ? 0 : 1]?.[1];
    const foreign = typeof previous === 'string' && decodeWorkerRecord(previous)?.startedAt !== this.startedAt;
    if (foreign && !this.foreignSeen) {
      this.logger.error({ workerId: record.workerId }, 'another live worker writes this WORKER_ID: give each worker its own id');
    }
    this.foreignSeen = foreign;
  }

  /** Stops heartbeating and removes the record: gateways stop listing this worker at once. */
  async stop(): Promise<void> {
    clearInterval(this.timer);
    const workerId = this.record().workerId;
    await this.redis.multi().del(this.names.workerKey(workerId)).zrem(this.names.workersIndexKey, workerId).exec();
  }
}
