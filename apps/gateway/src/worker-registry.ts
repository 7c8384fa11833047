import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { decodeWorkerRecord, type RedisNames, type WorkerRecord } from '@sluice/protocol';
import { GatewayError } from './errors.js';

export interface ServedModel {
  id: string;
  maxContextLength: number;
  workers: number;
  /** Smallest max batch of its workers: the most choices (`n`) one request may ask for. */
  maxBatchSize?: number;
  /** Smallest KV cache of its workers (tokens over all sequences): a request's n × (prompt + max_tokens) must fit. */
  maxCachedTokens?: number;
  /** Content hash of the model card (tokenizer, chat template) its workers publish. */
  modelCard?: string;
}

/** What the routes need to know about the workers. */
export interface ModelCatalog {
  readonly liveWorkerCount: number;
  models(): ServedModel[];
  /** Throws `model_not_found` (or `no_workers` when no worker is live at all). */
  requireModel(id: string): ServedModel;
}

/**
 * The live workers' records, by id (a member of the index whose key expired, or whose record is
 * malformed, is left out), and how many ids the index holds.
 */
export async function readWorkerRecords(redis: Redis, names: RedisNames): Promise<{ indexed: number; workers: Map<string, WorkerRecord> }> {
  const ids = await redis.zrange(names.workersIndexKey, '0', '-1');
  const raws = ids.length === 0 ? [] : await redis.mget(ids.map((id) => names.workerKey(id)));
  const workers = new Map<string, WorkerRecord>();
  ids.forEach((id, i) => {
    const raw = raws[i];
    const record = raw === null || raw === undefined ? undefined : decodeWorkerRecord(raw);
    if (record !== undefined) workers.set(id, record);
  });
  return { indexed: ids.length, workers };
}

/** Index members whose key expired this long ago are dropped from the index. */
const INDEX_GC_MS = 60_000;

/**
 * The gateway's view of the worker registry, re-read every `pollMs`. Each worker keeps a key with a
 * TTL alive by heartbeat, indexed by a sorted set; a worker whose key two reads in a row did not find
 * is gone.
 */
export class WorkerRegistry implements ModelCatalog {
  private workers = new Map<string, WorkerRecord>();
  /** Workers the latest read did not find, counted live for that one read (see {@link refresh}). */
  private missing = new Set<string>();
  /** Live workers that still take jobs (not draining after SIGTERM). */
  private servingCount = 0;
  private byModel = new Map<string, ServedModel>();
  private timer: NodeJS.Timeout | undefined;
  private polling = false;

  constructor(
    private readonly redis: Redis,
    private readonly names: RedisNames,
    private readonly pollMs: number,
    private readonly logger: Logger,
    /**
     * Called after each successful read with the live worker ids, when the read started, and the
     * records (as last read) of the workers this read and the one before it did not find, or that this
     * one finds started anew (another process under the same id): lost. A replaced id is not live in that
     * read's ids, so that the streams its old process accepted move.
     */
    private readonly onSnapshot: (liveWorkerIds: ReadonlySet<string>, takenAt: number, lost: readonly WorkerRecord[]) => void,
  ) {}

  /** Workers that take new jobs: a draining worker still finishes its streams but counts no more. */
  get liveWorkerCount(): number {
    return this.servingCount;
  }

  start(): void {
    this.timer = setInterval(() => void this.poll(), this.pollMs);
    this.timer.unref();
  }

  stop(): void {
    clearInterval(this.timer);
  }

  models(): ServedModel[] {
    return [...this.byModel.values()];
  }

  requireModel(id: string): ServedModel {
    const model = this.byModel.get(id);
    if (model !== undefined) return model;
    if (this.servingCount === 0) throw new GatewayError('no_workers');
    throw new GatewayError('model_not_found', { message: `The model '${id}' does not exist.`, param: 'model' });
  }

  /** Reads the registry once; errors propagate (the caller decides whether they are fatal). */
  async refresh(): Promise<void> {
    const takenAt = Date.now();
    const { indexed, workers } = await readWorkerRecords(this.redis, this.names);
    // A record missing from one read stays for that read: a worker is gone when two reads in a row
    // lack it. A Redis that stopped serving for longer than the records' TTL (paused, stalled by a
    // slow command or a fork) lets every record expire while every worker's beats wait in its socket;
    // they land as it serves again, ahead of the next read. Judged on one read, every stream of every
    // worker moved (or ended, `worker_lost`) after such a stall.
    const missing = new Set<string>();
    for (const [workerId, record] of this.workers) {
      if (workers.has(workerId) || this.missing.has(workerId)) continue;
      workers.set(workerId, record);
      missing.add(workerId);
    }
    this.missing = missing;
    const byModel = new Map<string, ServedModel>();
    // A draining worker is still alive (its streams go on) but serves no new request.
    const serving = [...workers.values()].filter((record) => !record.draining);
    for (const record of serving) {
      const model = byModel.get(record.modelId);
      if (model === undefined) {
        const served: ServedModel = {
          id: record.modelId,
          maxContextLength: record.maxContextLength,
          workers: 1,
          maxBatchSize: record.maxBatchSize,
        };
        if (record.maxCachedTokens !== undefined) served.maxCachedTokens = record.maxCachedTokens;
        if (record.modelCard !== undefined) served.modelCard = record.modelCard;
        byModel.set(record.modelId, served);
      } else {
        model.workers++;
        model.maxContextLength = Math.min(model.maxContextLength, record.maxContextLength);
        model.maxBatchSize = Math.min(model.maxBatchSize ?? record.maxBatchSize, record.maxBatchSize);
        if (record.maxCachedTokens !== undefined)
          model.maxCachedTokens = Math.min(model.maxCachedTokens ?? record.maxCachedTokens, record.maxCachedTokens);
        if (model.modelCard === undefined && record.modelCard !== undefined) model.modelCard = record.modelCard;
      }
    }
    // Lost: a worker whose record expired, and one whose id came back under another process (a record
    // that started anew: it died, and a worker with the same WORKER_ID registered within its TTL, so its
    // id never went missing). The new process is live from the next read on; what the old one held moves.
    const lost = [...this.workers.values()].filter((record) => workers.get(record.workerId)?.startedAt !== record.startedAt);
    const live = new Set(workers.keys());
    for (const record of lost) live.delete(record.workerId);
    this.workers = workers;
    this.servingCount = serving.length;
    this.byModel = byModel;
    this.onSnapshot(live, takenAt, lost);
    if (indexed > workers.size) {
      await this.redis.zremrangebyscore(this.names.workersIndexKey, '-inf', String(takenAt - INDEX_GC_MS));
    }
  }

  private async poll(): Promise<void> {
    if (this.polling) return;
    this.polling = true;
    try {
      await this.refresh();
    } catch (error) {
      this.logger.warn({ err: error }, 'reading the worker registry failed');
    } finally {
      this.polling = false;
    }
  }
}
