/**
 * Names of everything the processes share in Redis: the BullMQ queue, pub/sub channels and keys.
 * Every name carries a prefix so that several deployments can share one Redis.
 */

/** Default prefix of every Sluice key and channel. */
export const DEFAULT_PREFIX = 'sluice';

/** Name of the BullMQ queue that carries generation jobs (BullMQ adds its own `bull:` key prefix). */
export const GENERATE_QUEUE = 'generate';

/** BullMQ job name of a generation job. */
export const GENERATE_JOB = 'generate';

/** Builds every key and channel name from one prefix. */
export function redisNames(prefix: string = DEFAULT_PREFIX) {
  return {
    /** BullMQ key prefix (BullMQ builds `${bullPrefix}:${queue}:...`). */
    bullPrefix: `${prefix}:bull`,
    /** The one channel of a gateway process (`<GATEWAY_ID>.<boot id>`): every message for its requests arrives here. */
    gatewayChannel: (gatewayId: string) => `${prefix}:gw:${gatewayId}`,
    /** The channel every worker subscribes to for cancels and route changes (control messages). */
    controlChannel: `${prefix}:control`,
    /** The channel every gateway subscribes to besides its own: news for all of them (a revoked API key). */
    gatewaysChannel: `${prefix}:gateways`,
    /** Set by a live gateway (PX TTL): a worker whose publish reached nobody checks it before it gives up on the gateway. */
    gatewayAliveKey: (channel: string) => `${channel}:alive`,
    /**
     * A request's token log (a Redis Stream of its entries, ids `<seq>-1`). The `{<id>}` hash tag keeps a
     * request's keys in one Redis Cluster slot, so its Lua scripts stay legal there.
     */
    logKey: (requestId: string) => `${prefix}:{${requestId}}:log`,
    /** A request's state hash (route, attempt, grace, format of its chunks): see request-meta.ts. */
    metaKey: (requestId: string) => `${prefix}:{${requestId}}:meta`,
    /** Marker that a request was cancelled; a worker that takes the job later skips it. */
    cancelMarkerKey: (requestId: string) => `${prefix}:cancelled:${requestId}`,
    /** A model card (tokenizer, chat template, context length) by content hash: see model-card.ts. */
    modelCardKey: (hash: string) => `${prefix}:model-card:${hash}`,
    /** A worker's registry record, kept alive by its heartbeat (PX TTL). */
    workerKey: (workerId: string) => `${prefix}:worker:${workerId}`,
    /** Sorted set of worker ids (score: last heartbeat, ms since epoch): the index of `workerKey`s. */
    workersIndexKey: `${prefix}:workers`,
    /** An `Idempotency-Key` record (by digest of API key and key): the request it admitted and its body's digest. */
    idempotencyKey: (digest: string) => `${prefix}:idem:${digest}`,
  } as const;
}

export type RedisNames = ReturnType<typeof redisNames>;

/** BullMQ job id of a request's `attempt` (BullMQ ids cannot hold `:`): the first is the request id itself. */
export function attemptJobId(requestId: string, attempt: number): string {
  return attempt === 1 ? requestId : `${requestId}.a${attempt}`;
}

/**
 * The request and attempt a BullMQ job id names ({@link attemptJobId} read back): a scan of the queue's
 * jobs learns them from the ids alone, without reading each job's data (its prompt). The gateway makes
 * request ids (a UUID, `.p<k>` for a batch's prompts), so none ends in `.a<n>` of its own.
 */
export function parseAttemptJobId(jobId: string): { requestId: string; attempt: number } {
  const match = /^(.+)\.a([1-9]\d*)$/.exec(jobId);
  return match === null ? { requestId: jobId, attempt: 1 } : { requestId: match[1] as string, attempt: Number(match[2]) };
}

/**
 * Request (and first job) id of prompt `k` of a completions batch whose reply has id `requestId`: the
 * first keeps the reply's id, so a cancel by that id finds the others.
 */
export function batchRequestId(requestId: string, k: number): string {
  return k === 0 ? requestId : `${requestId}.p${k}`;
}
