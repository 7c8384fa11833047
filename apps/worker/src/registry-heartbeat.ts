import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { encodeModelCard, encodeWorkerRecord, modelCardHash, type ModelCard, type RedisNames, type WorkerRecord } from '@sluice/protocol';

/** A model card outlives the last heartbeat that touched it by this long (gateways cache it anyway). */
const CARD_TTL_MS = 24 * 3600_000;

/**
 * Keeps this worker's registry record alive: a key with a TTL rewritten every `heartbeatMs`, plus an
 * entry in the workers index. A worker that dies stops heartbeating; gateways see its key expire.
 */
export class RegistryHeartbeat {
  private timer: NodeJS.Timeout | undefined;
  private readonly startedAt = Date.now();
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
    // Before the first record names it: a gateway never sees a hash it cannot load.
    if (this.card !== undefined) await this.redis.set(this.names.modelCardKey(this.card.hash), this.card.encoded, 'PX', CARD_TTL_MS);
    await this.beat();
    this.timer = setInterval(() => {
      this.beat().catch((error: unknown) => this.logger.warn({ err: error }, 'registry heartbeat failed'));
    }, this.heartbeatMs);
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
      .set(this.names.workerKey(record.workerId), encodeWorkerRecord(record), 'PX', this.ttlMs)
      .zadd(this.names.workersIndexKey, String(now), record.workerId)
      .exec();
    if (card !== undefined && results?.[0]?.[1] !== 1) {
      await this.redis.set(this.names.modelCardKey(card.hash), card.encoded, 'PX', CARD_TTL_MS);
    }
  }

  /** Stops heartbeating and removes the record: gateways stop listing this worker at once. */
  async stop(): Promise<void> {
    clearInterval(this.timer);
    const workerId = this.record().workerId;
    await this.redis.multi().del(this.names.workerKey(workerId)).zrem(this.names.workersIndexKey, workerId).exec();
  }
}
