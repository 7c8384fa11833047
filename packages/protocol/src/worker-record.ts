import { z } from 'zod';

/** A worker's entry in the registry; its key expires when the worker stops heartbeating. */
export const workerRecordSchema = z.object({
  workerId: z.string(),
  /** Model id served under `/v1/models` and matched against a request's `model`. */
  modelId: z.string(),
  /** Max prompt + completion tokens. */
  maxContextLength: z.number().int().positive(),
  maxBatchSize: z.number().int().positive(),
  /** Tokens its KV cache holds over all sequences: a request's n × (prompt + max_tokens) must fit. */
  maxCachedTokens: z.number().int().positive().optional(),
  /** ms since epoch. */
  startedAt: z.number(),
  /** ms since epoch of this record's write. */
  heartbeatAt: z.number(),
  /** Sequences the worker is generating. */
  running: z.number().int().nonnegative(),
  /** Content hash of the worker's model card (`modelCardKey`): how gateways tokenize for this model. */
  modelCard: z.string().optional(),
  /** Set once the worker got SIGTERM: it takes no new jobs. */
  draining: z.boolean(),
  /**
   * Its BullMQ worker's id: the lock of every job it holds is `<queueWorkerId>:<n>`. A gateway that
   * sees this worker lost finds the jobs it took and had not accepted yet by their locks.
   */
  queueWorkerId: z.string().optional(),
});
export type WorkerRecord = z.infer<typeof workerRecordSchema>;

export function encodeWorkerRecord(record: WorkerRecord): string {
  return JSON.stringify(record);
}

/** Returns undefined for a malformed record (a foreign or older writer): it is ignored, not fatal. */
export function decodeWorkerRecord(raw: string | Buffer): WorkerRecord | undefined {
  try {
    const result = workerRecordSchema.safeParse(JSON.parse(typeof raw === 'string' ? raw : raw.toString('utf8')));
    return result.success ? result.data : undefined;
  } catch {
    return undefined;
  }
}
