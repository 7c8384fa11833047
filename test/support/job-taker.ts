/**
 * A process in the state a worker is in between taking a job and accepting it: registered like a
 * worker (a copy of a live worker's registry record under its own id, with its BullMQ worker's id), it
 * takes one job off the real queue with BullMQ (the job goes active, locked by this process) and never
 * writes anything for it. A test SIGKILLs it there, as a worker can die in that moment (a window of a
 * few milliseconds in the real worker, which no signal can be timed to hit).
 * Run with `node --import tsx test/support/job-taker.ts`. Env: REDIS_URL, TAKER_ID, WORKER_TTL_MS
 * (default 1500), LOCK_DURATION_MS (default 30000). Prints `registered <queue worker id>`, then
 * `took <job id>`; SIGUSR1 then makes it write as a worker that only looked dead would (below).
 */
import { Worker } from 'bullmq';
import { Redis } from 'ioredis';
import { pino } from 'pino';
import {
  encodeEntry,
  GENERATE_QUEUE,
  liveGatewayMessage,
  redisNames,
  RequestScripts,
  type GatewayEntry,
  type GenerateJob,
} from '@sluice/protocol';
import { readWorkerRecords } from '../../apps/gateway/dist/worker-registry.js';
import { RegistryHeartbeat } from '../../apps/worker/dist/registry-heartbeat.js';

const names = redisNames();
const takerId = process.env.TAKER_ID ?? 'job-taker';
const ttlMs = Number(process.env.WORKER_TTL_MS ?? 1500);
const redis = new Redis(process.env.REDIS_URL!);
const connection = new Redis(process.env.REDIS_URL!, { maxRetriesPerRequest: null });

// A live worker's record (its model, limits and model card), so that gateways admit requests for it.
const model = [...(await readWorkerRecords(redis, names)).workers.values()][0];
if (model === undefined) throw new Error('job-taker: no live worker record to copy');

const worker = new Worker(GENERATE_QUEUE, undefined, {
  connection,
  prefix: names.bullPrefix,
  autorun: false,
  lockDuration: Number(process.env.LOCK_DURATION_MS ?? 30_000),
});
// Registered as a worker registers (its BullMQ id in the record), before it takes a job.
await new RegistryHeartbeat(
  redis,
  names,
  ttlMs,
  Math.floor(ttlMs / 6),
  () => ({ ...model, workerId: takerId, queueWorkerId: worker.id, running: 0, draining: false }),
  pino({ level: 'silent' }),
).start();
console.log(`registered ${worker.id}`);

// A blocking fetch gives up after a while with nothing: wait on until a job comes.
let job = await worker.getNextJob(`${worker.id}:0`);
while (job === undefined) job = await worker.getNextJob(`${worker.id}:0`);
console.log(`took ${job.id}`);

// SIGUSR1: write what a worker that only looked dead writes once it runs again — its `accepted` and a
// first token for the job's attempt, appended to the log and published to the request's route in one
// command, as the worker's step router does. Prints `wrote <appended: 1, or 0 when fenced out>`.
const data = job.data as GenerateJob;
const scripts = new RequestScripts(redis, names);
process.on('SIGUSR1', () => {
  const attempt = data.continuation?.attempt ?? 1;
  const entries: GatewayEntry[] = [
    { requestId: data.requestId, seq: 0, type: 'accepted', workerId: takerId, promptTokens: 1, attempt },
    { requestId: data.requestId, seq: 1, type: 'text-delta', index: 0, text: ' LATE', tokens: 1, tokenIds: [7], attempt },
  ];
  void (async () => {
    const channel = (await redis.hget(names.metaKey(data.requestId), 'channel')) ?? '';
    const encoded = entries.map(encodeEntry);
    const pairs = entries.flatMap((entry, i) => [String(entry.seq), encoded[i]!.logged]);
    const { appended } = await scripts.writeEntries(
      [{ requestId: data.requestId, attempt, maxEntries: 1000, ttlMs: 60_000, workerId: takerId, pairs }],
      channel === ''
        ? []
        : [
            {
              channel,
              message: liveGatewayMessage(
                takerId,
                encoded.map((e) => e.live),
              ),
            },
          ],
    );
    console.log(`wrote ${String(appended[0])}`);
  })();
});
