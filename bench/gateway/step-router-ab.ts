/**
 * `BASELINE_TREE=<checkout> node --import tsx bench/gateway/step-router-ab.ts`: the worker's step
 * router (`apps/worker/dist/step-router.js`) of this tree against another checkout's (built), each on
 * its own connection to one private redis-server: per engine step it routes a text delta for every
 * row, sends the step's appends and publish, and waits for Redis's replies. Prints the router's
 * process CPU per step for each side, rounds alternating, and the medians, and the young-generation
 * collections (scavenges) each side's rounds made: its garbage. ROWS (`1,32`), STEPS (3000 a round),
 * ROUNDS (5).
 */
import { constants, PerformanceObserver, type PerformanceEntry } from 'node:perf_hooks';
import { Redis } from 'ioredis';
import { pino } from 'pino';
import type { StepEvent } from '@sluice/engine';
import { redisNames } from '@sluice/protocol';
import type { StepRouter } from '../../apps/worker/dist/step-router.js';
import { startRedis } from '../../test/support/redis-server.js';
import { median, round } from './stats.js';

const baseline = process.env.BASELINE_TREE;
if (baseline === undefined) throw new Error('BASELINE_TREE: the checkout to compare with');
const rowsList = (process.env.ROWS ?? '1,32').split(',').map(Number);
const steps = Number(process.env.STEPS ?? 3000);
const rounds = Number(process.env.ROUNDS ?? 5);

const redis = await startRedis();
const connections: Redis[] = [];
const sides: Array<{ name: string; router: StepRouter }> = [];
for (const [name, tree] of [
  ['before', `${baseline}/`],
  ['after', new URL('../../', import.meta.url).pathname],
] as const) {
  const module = (await import(`${tree}apps/worker/dist/step-router.js`)) as { StepRouter: typeof StepRouter };
  // The worker's command connection: nothing queued while Redis is away.
  const connection = new Redis(redis.url, { enableOfflineQueue: false, lazyConnect: true });
  await connection.connect();
  connections.push(connection);
  const options = { workerId: 'bench', names: redisNames(), retentionMs: 60_000, maxLogEntries: 10_000 };
  sides.push({ name, router: new module.StepRouter(connection, options, pino({ level: 'warn' })) });
}
// A gateway listening, so that every publish reaches a subscriber as in a deployment.
const subscriber = redis.client();
await subscriber.subscribe('bench-gateway');

let scavenges = 0;
const gcObserver = new PerformanceObserver((list) => {
  for (const entry of list.getEntries()) {
    if ((entry as PerformanceEntry & { detail?: { kind?: number } }).detail?.kind === constants.NODE_PERFORMANCE_GC_MINOR) scavenges++;
  }
});
gcObserver.observe({ entryTypes: ['gc'] });

for (const rows of rowsList) {
  const cpu = sides.map(() => [] as number[]);
  const gcs = sides.map(() => [] as number[]);
  for (let r = 0; r < rounds; r++) {
    // Sides alternate which goes first.
    for (const k of r % 2 === 0 ? [0, 1] : [1, 0]) {
      const { router } = sides[k]!;
      const ids = Array.from({ length: rows }, (_, i) => `bench-${rows}-${k}-${r}-${i}`);
      const routes = ids.map((requestId) =>
        router.open({
          requestId,
          channel: 'bench-gateway',
          attempt: 1,
          deadlineAt: Date.now() + 600_000,
          graceMs: 1000,
          nextSeq: 0,
          abort: () => {},
          onFinish: () => {},
        }),
      );
      const step = ids.map((id): StepEvent => [id, { type: 'text-delta', index: 0, tokenIds: [17], text: ' token' }]);
      const one = async () => {
        router.onEvents(step);
        await router.drained();
      };
      for (let i = 0; i < 100; i++) await one();
      const start = process.cpuUsage();
      const scavengesBefore = scavenges;
      for (let i = 0; i < steps; i++) await one();
      const used = process.cpuUsage(start);
      // The observer hears of a collection a turn later.
      await new Promise((resolve) => setImmediate(resolve));
      cpu[k]!.push((used.user + used.system) / steps);
      gcs[k]!.push(scavenges - scavengesBefore);
      for (const route of routes) router.close(route);
    }
  }
  console.log(
    `${rows} row(s) a step: router CPU per step, µs (median of ${rounds} rounds of ${steps} steps; per round) ` +
      sides.map(({ name }, k) => `${name} ${round(median(cpu[k]!), 1)} (${cpu[k]!.map((x) => Math.round(x)).join(' ')})`).join(', ') +
      `; after ÷ before ${round(median(cpu[1]!) / median(cpu[0]!), 2)}; scavenges a round ` +
      sides.map(({ name }, k) => `${name} ${median(gcs[k]!)} (${gcs[k]!.join(' ')})`).join(', '),
  );
}
gcObserver.disconnect();
await subscriber.quit();
for (const connection of connections) await connection.quit();
await redis.stop();
