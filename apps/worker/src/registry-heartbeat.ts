import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { encodeWorkerRecord, type RedisNames, type WorkerRecord } from '@sluice/protocol';

/**
 * Keeps this worker's registry record alive: a key with a TTL rewritten every `heartbeatMs`, plus an
 * entry in the workers index. A worker that dies stops heartbeating; gateways see its key expire.
 */
export class RegistryHeartbeat {
  private timer: NodeJS.Timeout | undefined;
  private readonly startedAt = Date.now();

  constructor(
    private readonly redis: Redis,
    private readonly names: RedisNames,
    private readonly ttlMs: number,
    private readonly heartbeatMs: number,
    private readonly record: () => Omit<WorkerRecord, 'startedAt' | 'heartbeatAt'>,
    private readonly logger: Logger,
  ) {}

  async start(): Promise<void> {
    await this.beat();
    this.timer = setInterval(() => {
      this.beat().catch((error: unknown) => this.logger.warn({ err: error }, 'registry heartbeat failed'));
    }, this.heartbeatMs);
  }

  async beat(): Promise<void> {
    const now = Date.now();
    const record: WorkerRecord = { ...this.record(), startedAt: this.startedAt, heartbeatAt: now };
    await this.redis
      .multi()
      .set(this.names.workerKey(record.workerId), encodeWorkerRecord(record), 'PX', this.ttlMs)
      .zadd(this.names.workersIndexKey, String(now), record.workerId)
      .exec();
  }

  /** Stops heartbeating and removes the record: gateways stop listing this worker at once. */
  async stop(): Promise<void> {
    clearInterval(this.timer);
    const workerId = this.record().workerId;
    await this.redis.multi().del(this.names.workerKey(workerId)).zrem(this.names.workersIndexKey, workerId).exec();
  }
}
