/** Registry records as a worker writes them, for tests that read the registry. */
import type { Redis } from 'ioredis';
import { encodeWorkerRecord, type RedisNames, type WorkerRecord } from '@sluice/protocol';

/** A serving worker's record (model `m`), with `fields` over the defaults. */
export function workerRecord(workerId: string, fields: Partial<WorkerRecord> = {}): WorkerRecord {
  return {
    workerId,
    modelId: 'm',
    maxContextLength: 64,
    maxBatchSize: 4,
    startedAt: 1,
    heartbeatAt: Date.now(),
    running: 0,
    draining: false,
    ...fields,
  };
}

/** Writes `record` and indexes it, as a worker's beat does (no TTL). */
export async function register(redis: Redis, names: RedisNames, record: WorkerRecord): Promise<void> {
  await redis
    .multi()
    .set(names.workerKey(record.workerId), encodeWorkerRecord(record))
    .zadd(names.workersIndexKey, Date.now(), record.workerId)
    .exec();
}
