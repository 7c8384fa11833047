/**
 * A process in the state a worker is in between taking a job and accepting it: registered like a
 * worker (a copy of a live worker's registry record under its own id, with its BullMQ worker's id), it
 * takes one job off the real queue with BullMQ (the job goes active, locked by this process) and never
 * writes anything for it. A test SIGKILLs it there, as a worker can die in that moment (a window of a
 * few milliseconds in the real worker, which no signal can be timed to hit).
 * Run with `node --import tsx test/support/job-taker.ts`. Env: REDIS_URL, TAKER_ID, WORKER_TTL_MS
 * (default 1500), LOCK_DURATION_MS (default 30000). Prints `registered <queue worker id>`, then
 * `took <job id>`.
 */
import { Worker } from 'bullmq';
import { Redis } from 'ioredis';
import { decodeWorkerRecord, encodeWorkerRecord, GENERATE_QUEUE, redisNames } from '@sluice/protocol';

const names = redisNames();
const takerId = process.env.TAKER_ID ?? 'job-taker';
const ttlMs = Number(process.env.WORKER_TTL_MS ?? 1500);
const redis = new Redis(process.env.REDIS_URL!);
const connection = new Redis(process.env.REDIS_URL!, { maxRetriesPerRequest: null });

// A live worker's record (its model, limits and model card), so that gateways admit requests for it.
const ids = await redis.zrange(names.workersIndexKey, '0', '-1');
const raws = ids.length === 0 ? [] : await redis.mget(ids.map((id) => names.workerKey(id)));
const model = raws.map((raw) => (raw === null ? undefined : decodeWorkerRecord(raw))).find((record) => record !== undefined);
if (model === undefined) throw new Error('job-taker: no live worker record to copy');

const worker = new Worker(GENERATE_QUEUE, undefined, {
  connection,
  prefix: names.bullPrefix,
  autorun: false,
  lockDuration: Number(process.env.LOCK_DURATION_MS ?? 30_000),
});
const beat = () =>
  redis
    .multi()
    .set(
      names.workerKey(takerId),
      encodeWorkerRecord({ ...model, workerId: takerId, queueWorkerId: worker.id, running: 0, draining: false, heartbeatAt: Date.now() }),
      'PX',
      ttlMs,
    )
    .zadd(names.workersIndexKey, String(Date.now()), takerId)
    .exec();
await beat();
setInterval(() => void beat(), Math.floor(ttlMs / 6));
console.log(`registered ${worker.id}`);

// A blocking fetch gives up after a while with nothing: wait on until a job comes.
let job = await worker.getNextJob(`${worker.id}:0`);
while (job === undefined) job = await worker.getNextJob(`${worker.id}:0`);
console.log(`took ${job.id}`);
