/**
 * `npm run bench:recovery`: what a gateway's look through BullMQ's active jobs costs when a worker is
 * lost (`RedisJobQueue.recoverLost`; every gateway runs it on every loss it sees) with a deep batch of
 * running requests, none of them the lost worker's. A real redis-server and BullMQ: BENCH_JOBS jobs of
 * BENCH_PROMPT_TOKENS prompt tokens each are enqueued as the gateway does and taken (active, locked) by
 * a live worker; then the scan runs BENCH_SCANS times. Prints the median time of a scan and the bytes
 * Redis sent for it (`INFO stats` total_net_output_bytes, before and after), and the longest round trip
 * another client's PING took meanwhile (Redis runs one command or script at a time: what the scan
 * holds up on the token path). Columns: workload | scan | bytes | longest PING.
 */
import { Queue, Worker } from 'bullmq';
import { pino } from 'pino';
import { GENERATE_QUEUE, redisNames, type GenerateJob } from '@sluice/protocol';
import { RedisJobQueue } from '../../apps/gateway/src/job-queue.js';
import { startRedis } from '../../test/support/redis-server.js';
import { workerRecord } from '../../test/support/worker-records.js';

const jobCount = Number(process.env.BENCH_JOBS ?? 1000);
const promptTokens = Number(process.env.BENCH_PROMPT_TOKENS ?? 4096);
const scans = Number(process.env.BENCH_SCANS ?? 7);
const log = (message: string) => process.stderr.write(`[bench:recovery] ${message}\n`);

async function main(): Promise<void> {
  const server = await startRedis();
  const redis = server.client();
  const connection = server.client();
  const names = redisNames('bench-recovery');
  const queue = new Queue(GENERATE_QUEUE, { connection, prefix: names.bullPrefix });
  const takerConnection = server.client();
  const taker = new Worker(GENERATE_QUEUE, undefined, { connection: takerConnection, prefix: names.bullPrefix, autorun: false });
  try {
    const jobs = new RedisJobQueue(queue, connection, names, 'gw-bench', 600_000, 3, pino({ level: 'silent' }));
    const format = { endpoint: 'chat' as const, model: 'm', created: 1, includeUsage: false, n: 1, maxTokensParam: 'max_tokens' as const };
    const prompt = Array.from({ length: promptTokens }, (_, i) => (i * 7919) % 49152);
    for (let i = 0; i < jobCount; i++) {
      const job: GenerateJob = {
        requestId: `00000000-0000-4000-8000-${String(i).padStart(12, '0')}`,
        channel: 'gw-other',
        model: 'm',
        input: { kind: 'tokens', promptTokenIds: prompt },
        sampling: { maxTokens: 256 },
        defaultMaxTokens: 256,
        resumeGraceMs: 0,
        enqueuedAt: Date.now(),
        deadlineAt: Date.now() + 600_000,
      };
      await jobs.submit(job, format);
      await taker.getNextJob(`${taker.id}:${i}`);
    }
    log(`${jobCount} active jobs of ${promptTokens} prompt tokens each; ${scans} scans`);
    const lost = [workerRecord('gone', { queueWorkerId: 'queue-gone' })];
    const outputBytes = async (): Promise<number> => Number(/total_net_output_bytes:(\d+)/.exec(await redis.info('stats'))?.[1]);
    const times: number[] = [];
    const bytes: number[] = [];
    const stalls: number[] = [];
    // Another client's commands meanwhile (a worker's appends, say): the longest PING round trip.
    const other = server.client();
    for (let i = 0; i < scans; i++) {
      const before = await outputBytes();
      let scanning = true;
      let longest = 0;
      const pinging = (async () => {
        while (scanning) {
          const sent = performance.now();
          await other.ping();
          longest = Math.max(longest, performance.now() - sent);
        }
      })();
      const start = performance.now();
      const moved = await jobs.recoverLost(lost, () => false);
      times.push(performance.now() - start);
      scanning = false;
      await pinging;
      stalls.push(longest);
      bytes.push((await outputBytes()) - before);
      if (moved !== 0) throw new Error(`the scan moved ${moved} jobs: none is the lost worker's`);
    }
    const median = (values: number[]) => [...values].sort((a, b) => a - b)[values.length >> 1] as number;
    console.log(
      `| ${jobCount} active jobs × ${promptTokens} prompt tokens | ${median(times).toFixed(1)} ms | ${(median(bytes) / 1e6).toFixed(2)} MB | ${median(stalls).toFixed(1)} ms |`,
    );
    other.disconnect();
  } finally {
    await taker.close(true);
    await queue.close();
    takerConnection.disconnect();
    connection.disconnect();
    redis.disconnect();
    await server.stop();
  }
}

await main();
