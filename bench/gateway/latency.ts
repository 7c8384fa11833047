/**
 * TTFT and ITL of the same workload two ways: the engine called in process, and through
 * gateway + Redis + worker processes (client → HTTP/SSE → gateway → BullMQ → worker → engine →
 * pub/sub → gateway → client). Times are measured where the caller sees text: the first and each
 * following non-empty text delta (engine) or content chunk (SSE).
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import { fileURLToPath } from 'node:url';
import { createEngine } from '@sluice/engine';
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { percentile, round } from './stats.js';

const root = fileURLToPath(new URL('../..', import.meta.url));

export interface LatencyWorkload {
  concurrency: number;
  maxTokens: number;
  /** Delay between request starts, ms. */
  staggerMs: number;
  maxBatchSize: number;
  /** onnxruntime intra-op threads, the same on both sides. */
  intraOpThreads: number;
  /** Built-in model: `bench` (~28M parameters, compute-bound steps) or `tiny`. */
  preset: 'tiny' | 'bench';
}

export interface LatencySamples {
  ttftMs: number[];
  itlMs: number[];
}

export interface LatencySummary {
  ttftMs: { p50: number; p99: number };
  itlMs: { p50: number; p99: number };
  requests: number;
  itlSamples: number;
}

export function summarize(samples: LatencySamples): LatencySummary {
  return {
    ttftMs: { p50: round(percentile(samples.ttftMs, 50)), p99: round(percentile(samples.ttftMs, 99)) },
    itlMs: { p50: round(percentile(samples.itlMs, 50)), p99: round(percentile(samples.itlMs, 99)) },
    requests: samples.ttftMs.length,
    itlSamples: samples.itlMs.length,
  };
}

const prompts = (n: number) => Array.from({ length: n }, (_, i) => `Request ${i}: once upon a time, in a land far away, there lived`);
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

function record(samples: LatencySamples, start: number, times: number[]): void {
  if (times.length === 0) return;
  samples.ttftMs.push(times[0]! - start);
  for (let i = 1; i < times.length; i++) samples.itlMs.push(times[i]! - times[i - 1]!);
}

export interface InProcessEngine {
  run(samples: LatencySamples): Promise<void>;
  close(): Promise<void>;
}

/** The engine in this process, as the worker runs it (same model, options and tokenization of a text prompt). */
export async function inProcessEngine(workload: LatencyWorkload): Promise<InProcessEngine> {
  const modelDir = await ensureBuiltinModel(workload.preset);
  const model = await loadModelDir(modelDir);
  const engine = await createEngine({ modelDir, maxBatchSize: workload.maxBatchSize, intraOpThreads: workload.intraOpThreads });
  let next = 0;
  return {
    run: async (samples) => {
      await Promise.all(
        prompts(workload.concurrency).map(async (prompt, i) => {
          await sleep(i * workload.staggerMs);
          const start = performance.now();
          const times: number[] = [];
          const promptTokenIds = model.tokenizer.encode(prompt, { addSpecialTokens: true });
          const sampling = { maxTokens: workload.maxTokens, temperature: 0, ignoreEos: true };
          for await (const event of engine.generate({ id: `r${next++}`, promptTokenIds, sampling })) {
            if (event.type === 'text-delta' && event.text !== '') times.push(performance.now());
          }
          record(samples, start, times);
        }),
      );
    },
    close: () => engine.close(),
  };
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      server.close(() => resolve(typeof address === 'object' && address !== null ? address.port : 0));
    });
  });
}

function start(command: string, args: string[], env: Record<string, string>): ChildProcess {
  const child = spawn(command, args, { env: { ...process.env, ...env }, stdio: ['ignore', 'ignore', 'inherit'] });
  process.once('exit', () => child.kill('SIGKILL'));
  return child;
}

async function until(what: string, check: () => Promise<boolean>, timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check().catch(() => false))) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(50);
  }
}

export interface Deployment {
  url: string;
  stop(): Promise<void>;
}

/** redis-server + one worker + one gateway, as processes on loopback. */
export async function deploy(workload: LatencyWorkload): Promise<Deployment> {
  const redisPort = await freePort();
  const redis = start('redis-server', ['--port', String(redisPort), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--maxmemory-policy', 'noeviction'], {});
  const redisUrl = `redis://127.0.0.1:${redisPort}`;
  const workerPort = await freePort();
  const worker = start(process.execPath, [`${root}apps/worker/dist/main.js`], {
    REDIS_URL: redisUrl,
    MODEL_DIR: await ensureBuiltinModel(workload.preset),
    MAX_BATCH_SIZE: String(workload.maxBatchSize),
    INTRA_OP_THREADS: String(workload.intraOpThreads),
    METRICS_PORT: String(workerPort),
    METRICS_HOST: '127.0.0.1',
    LOG_LEVEL: 'warn',
  });
  const port = await freePort();
  await sleep(300);
  const gateway = start(process.execPath, [`${root}apps/gateway/dist/main.js`], {
    REDIS_URL: redisUrl,
    PORT: String(port),
    HOST: '127.0.0.1',
    LOG_LEVEL: 'warn',
    REGISTRY_POLL_MS: '200',
  });
  const url = `http://127.0.0.1:${port}`;
  await until('the gateway to see the worker', async () => (await fetch(`${url}/readyz`)).status === 200);
  const stopOne = (child: ChildProcess) =>
    new Promise<void>((resolve) => {
      if (child.exitCode !== null) return resolve();
      child.once('exit', () => resolve());
      child.kill('SIGTERM');
      setTimeout(() => child.kill('SIGKILL'), 5_000).unref();
    });
  return {
    url,
    stop: async () => {
      await Promise.all([stopOne(gateway), stopOne(worker)]);
      await stopOne(redis);
    },
  };
}

/** The same workload through the gateway, read raw off the SSE stream. */
export async function throughGateway(url: string, workload: LatencyWorkload, samples: LatencySamples): Promise<void> {
  const marker = Buffer.from('"text":"');
  await Promise.all(
    prompts(workload.concurrency).map(async (prompt, i) => {
      await sleep(i * workload.staggerMs);
      const start = performance.now();
      const res = await fetch(`${url}/v1/completions`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ model: workload.preset, prompt, max_tokens: workload.maxTokens, temperature: 0, ignore_eos: true, stream: true }),
      });
      const times: number[] = [];
      let buffered = '';
      for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
        const now = performance.now();
        buffered += Buffer.from(chunk).toString('utf8');
        let end: number;
        while ((end = buffered.indexOf('\n\n')) !== -1) {
          const frame = buffered.slice(0, end);
          buffered = buffered.slice(end + 2);
          // A content chunk: a non-empty "text" and no finish reason yet.
          if (frame.includes('"finish_reason":null') && frame.includes(marker.toString()) && !frame.includes('"text":""')) times.push(now);
        }
      }
      record(samples, start, times);
    }),
  );
}
