/**
 * What taking in a request costs each process of the stack: bursts of BURST concurrent streamed
 * completions (`POST /v1/completions`, token-id prompts of 8–25 tokens, MAX_TOKENS each, default 1),
 * ROUNDS rounds of BURSTS bursts, CPU time per request of the gateway, the worker's host thread, its
 * engine threads, redis-server and this load client, read from /proc around each round.
 *
 * The client's own CPU per request is the same code on both sides, so `gateway ÷ client` compares
 * runs on a VM whose speed moves. With `BASE_TREE=<a worktree of another commit, built>` a second
 * stack runs that tree's gateway and worker, rounds alternating: a side-by-side A/B.
 * Run: [BASE_TREE=/tmp/base] [ROUNDS=6] [BURSTS=20] [BURST=32] npm run bench:intake
 */
import { ensureBuiltinModel } from '@sluice/model';
import { startRedis, type RedisServer } from '../../test/support/redis-server.js';
import { startGateway, startWorker, type GatewayProcess, type WorkerProcess } from '../../test/support/sluice.js';
import { median } from '../gateway/stats.js';
import { ownCpu, processCpu } from './process-cpu.js';
import { streamCompletion } from './stream-client.js';

const root = new URL('../..', import.meta.url).pathname;
const rounds = Number(process.env.ROUNDS ?? 6);
const bursts = Number(process.env.BURSTS ?? 20);
const burst = Number(process.env.BURST ?? 32);
const maxTokens = Number(process.env.MAX_TOKENS ?? 1);

interface Stack {
  name: string;
  redis: RedisServer;
  gateway: GatewayProcess;
  worker: WorkerProcess;
}

async function startStack(name: string, tree: string, modelDir: string): Promise<Stack> {
  const redis = await startRedis();
  const worker = await startWorker(
    redis.url,
    { MODEL_DIR: modelDir, MODEL_ID: 'bench', MAX_BATCH_SIZE: String(burst), KV_PREALLOCATE: 'true', HEALTH_REQUEST_IDS: 'false' },
    { tree },
  );
  const gateway = await startGateway(redis.url, { MAX_QUEUED_REQUESTS: String(burst * 2) }, { tree });
  return { name, redis, gateway, worker };
}

function prompt(j: number): number[] {
  return Array.from({ length: 8 + (j % 18) }, (_, k) => 5 + ((k * 7 + j * 13) % 4000));
}

async function round(stack: Stack): Promise<Record<string, number>> {
  const cpu = () => {
    const worker = processCpu(stack.worker.process.pid);
    return {
      gateway: processCpu(stack.gateway.process.pid).total,
      'worker host': worker.mainThread,
      engine: worker.total - worker.mainThread,
      'redis-server': processCpu(stack.redis.process.pid).total,
      client: ownCpu(),
    };
  };
  const before = cpu();
  for (let b = 0; b < bursts; b++) {
    await Promise.all(
      Array.from({ length: burst }, (_, j) =>
        streamCompletion(stack.gateway.url, { model: 'bench', prompt: prompt(j), max_tokens: maxTokens, ignore_eos: true, temperature: 0 }),
      ),
    );
  }
  const after = cpu();
  const requests = bursts * burst;
  return Object.fromEntries(
    Object.entries(after).map(([part, s]) => [part, ((s - before[part as keyof typeof before]) / requests) * 1000]),
  );
}

const modelDir = await ensureBuiltinModel('bench');
const stacks = [await startStack('head', root, modelDir)];
if (process.env.BASE_TREE !== undefined) stacks.push(await startStack('base', `${process.env.BASE_TREE.replace(/\/?$/, '/')}`, modelDir));
try {
  // Warm-up: JIT and the engine's first prefill shapes, not measured.
  for (const stack of stacks) await round(stack);
  const results = new Map(stacks.map((s) => [s.name, [] as Array<Record<string, number>>]));
  for (let r = 0; r < rounds; r++) {
    const order = r % 2 === 0 ? stacks : [...stacks].reverse();
    for (const stack of order) {
      const result = await round(stack);
      results.get(stack.name)!.push(result);
      console.log(
        `round ${r + 1} ${stack.name}: ${Object.entries(result)
          .map(([k, v]) => `${k} ${v.toFixed(2)}`)
          .join(', ')} ms/request`,
      );
    }
  }
  console.log(`\nCPU ms per request, medians of ${rounds} rounds (${bursts} bursts of ${burst}, ${maxTokens} token(s) each):`);
  console.log('| side | gateway | worker host | engine | redis-server | client | gateway ÷ client |\n|---|---:|---:|---:|---:|---:|---:|');
  for (const [name, rows] of results) {
    const m = (part: string) => median(rows.map((row) => row[part]!));
    const ratio = median(rows.map((row) => row.gateway! / row.client!));
    console.log(
      `| ${name} | ${m('gateway').toFixed(2)} | ${m('worker host').toFixed(2)} | ${m('engine').toFixed(2)} | ${m('redis-server').toFixed(2)} | ${m('client').toFixed(2)} | ${ratio.toFixed(2)} |`,
    );
  }
} finally {
  for (const stack of stacks) {
    await Promise.all([stack.worker.process.stop(10_000), stack.gateway.process.stop(10_000)]);
    await stack.redis.stop();
  }
}
