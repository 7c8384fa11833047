/**
 * TTFT and ITL of the same workload two ways: the engine called in process, and through
 * gateway + Redis + worker processes (client → HTTP/SSE → gateway → BullMQ → worker → engine →
 * pub/sub → gateway → client). Times are measured where the caller sees text: the first and each
 * following non-empty text delta (engine) or content chunk (SSE).
 */
import { randomUUID } from 'node:crypto';
import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import { fileURLToPath } from 'node:url';
import { createEngine } from '@sluice/engine';
import { ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { engineOptions, loadWorkerConfig } from '../../apps/worker/dist/config.js';
import { readGcPauses, type StackGcPauses } from './gc-pauses.js';
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
  /** Through the gateway: when the client sent each request and read its first text (epoch ms), by request id. */
  clients?: ClientTiming[];
}

export interface ClientTiming {
  requestId: string;
  sentAt: number;
  firstReadAt: number;
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

/** The worker settings a latency workload sets (the in-process engine gets the same). */
function workerSettings(workload: LatencyWorkload): Record<string, string> {
  return { MAX_BATCH_SIZE: String(workload.maxBatchSize), INTRA_OP_THREADS: String(workload.intraOpThreads) };
}

/** The engine in this process, as the worker runs it (same model, options and tokenization of a text prompt). */
export async function inProcessEngine(workload: LatencyWorkload): Promise<InProcessEngine> {
  const modelDir = await ensureBuiltinModel(workload.preset);
  const model = await loadModelDir(modelDir);
  // The worker's own options for the same settings (the worker below also reads this process's env).
  const engine = await createEngine(engineOptions(loadWorkerConfig({ ...process.env, ...workerSettings(workload) }), modelDir));
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

function start(command: string, args: string[], env: Record<string, string>, onLine?: (line: string) => void): ChildProcess {
  const child = spawn(command, args, {
    env: { ...process.env, ...env },
    stdio: ['ignore', onLine === undefined ? 'ignore' : 'pipe', 'inherit'],
  });
  if (onLine !== undefined) {
    let rest = '';
    child.stdout!.setEncoding('utf8').on('data', (text: string) => {
      const lines = (rest + text).split('\n');
      rest = lines.pop() ?? '';
      for (const line of lines) onLine(line);
    });
  }
  process.once('exit', () => child.kill('SIGKILL'));
  return child;
}

/** A minimal `node:http` SSE server in its own process (`bare-sse-server.ts`): the HTTP floor of the TTFT. */
export async function bareServer(): Promise<{ url: string; stop(): Promise<void> }> {
  let resolvePort!: (port: number) => void;
  const port = new Promise<number>((resolve) => (resolvePort = resolve));
  const child = start(process.execPath, ['--import', 'tsx', `${root}bench/gateway/bare-sse-server.ts`], {}, (line) => {
    const match = /^port (\d+)$/.exec(line);
    if (match) resolvePort(Number(match[1]));
  });
  return { url: `http://127.0.0.1:${await port}`, stop: () => stopChild(child) };
}

/** SIGTERM, then SIGKILL after 5 s; resolves when the process has exited. */
function stopChild(child: ChildProcess): Promise<void> {
  return new Promise<void>((resolve) => {
    if (child.exitCode !== null) return resolve();
    child.once('exit', () => resolve());
    child.kill('SIGTERM');
    setTimeout(() => child.kill('SIGKILL'), 5_000).unref();
  });
}

/** The `timing` of a gateway's and a worker's `request finished` log lines (gateway-observer.ts, processor.ts). */
interface GatewayTiming {
  receivedAt: number;
  preparedMs: number;
  enqueuedMs?: number;
  acceptedMs?: number;
  firstTokenMs?: number;
}
interface WorkerTiming {
  pickedUpAt: number;
  checkedMs?: number;
  submittedMs?: number;
  firstStepMs?: number;
  publishedMs?: number;
  engineQueueMs: number;
  engineFirstTokenMs: number;
}

/** Spans before the first token, in order, per request (ms); they add up to the gateway's TTFT. */
export const TTFT_SPANS = [
  ['client send → gateway receive', 'client: `fetch` sends the request; gateway: HTTP parse, middleware, routing'],
  ['→ prompt ready', 'gateway: body read, validated, tokenized'],
  ['→ worker pickup', 'gateway writes meta + BullMQ add, worker wakes and moves the job to active'],
  ['→ engine submit', "worker: job parsed, the checks' read sent, sampling options, engine.submit (posts to the engine thread)"],
  ['→ first token on the engine thread', 'engine: thread hop, wait for the step, prefill + sample'],
  ['→ step on the worker host', 'engine thread → host message (structured clone), router gets the step'],
  [
    '→ pipeline answered',
    "worker: (the checks, if still out), entries serialized, the step's one command (log appends + publishes), Redis replies",
  ],
  ['→ written to the client', 'pub/sub delivery, gateway decode, dispatch, chunk formatting, write'],
  ['→ read by the client', 'loopback, `fetch` body stream, the client finds the text in the SSE frame'],
] as const;

function spansOf(g: GatewayTiming, w: WorkerTiming, c: ClientTiming): number[] | undefined {
  if (
    g.firstTokenMs === undefined ||
    w.checkedMs === undefined ||
    w.submittedMs === undefined ||
    w.firstStepMs === undefined ||
    w.publishedMs === undefined
  )
    return undefined;
  // One timeline in ms after the gateway received the request (all three processes read the same clock).
  const pickup = w.pickedUpAt - g.receivedAt;
  const points = [
    c.sentAt - g.receivedAt,
    0,
    g.preparedMs,
    pickup,
    pickup + w.submittedMs,
    pickup + w.submittedMs + w.engineFirstTokenMs,
    pickup + w.firstStepMs,
    pickup + w.publishedMs,
    g.firstTokenMs,
    c.firstReadAt - g.receivedAt,
  ];
  return points.slice(1).map((at, i) => at - points[i]!);
}

export interface TtftBreakdown {
  /** Per span, in TTFT_SPANS order: the median over requests, ms. */
  medianMs: number[];
  /** Per span: the 90th percentile over requests, ms (which spans make the TTFT's tail). */
  p90Ms: number[];
  /** Of `→ worker pickup`: the time the gateway waited for the meta write and BullMQ's add, median ms. */
  gatewayEnqueueMs: number;
  /** From the gateway's add answered to the worker's pickup (an idle worker taking a new job), median ms. */
  addToPickupMs: number;
  /** Of `→ first token on the engine thread`: submit → the step that took the request was scheduled, median ms. */
  engineQueueMs: number;
  /** The job's checks (cancel marker + meta, one round trip, overlapping the engine): answered this long after pickup, median ms. */
  checksMs: number;
  /** Requests whose first token waited for the checks, and by how long (median ms among them). */
  checksHeldBack: { requests: number; medianMs: number };
  requests: number;
  /** Requests left out of the spans: no `request finished` line from one of the processes, or a line without every field. */
  skipped: { noLogLines: number; missingFields: number };
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
  /** Forgets the log lines seen so far (a warm-up). */
  clearTimings(): void;
  /**
   * The TTFT breakdown of the requests finished since the last clear, once both processes' log lines of every
   * one of `clients` have come in (they are written after the stream ends), or after 5 s without them.
   */
  ttftBreakdown(clients: readonly ClientTiming[]): Promise<TtftBreakdown>;
  /** GC pauses so far of the gateway's and the worker's main threads (their /metrics). */
  gcPauses(): Promise<StackGcPauses>;
  stop(): Promise<void>;
}

/** redis-server + one worker + one gateway, as processes on loopback. */
export async function deploy(workload: LatencyWorkload): Promise<Deployment> {
  const redisPort = await freePort();
  const redis = start(
    'redis-server',
    ['--port', String(redisPort), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--maxmemory-policy', 'noeviction'],
    {},
  );
  const redisUrl = `redis://127.0.0.1:${redisPort}`;
  const workerPort = await freePort();
  const gatewayLines = new Map<string, GatewayTiming>();
  const workerLines = new Map<string, WorkerTiming>();
  /** Client's request id (X-Request-Id) → the gateway's job id. */
  const jobIds = new Map<string, string>();
  const collect = (into: Map<string, unknown>) => (line: string) => {
    if (!line.includes('"request finished"') || !line.includes('"timing"')) return;
    const parsed = JSON.parse(line) as { requestId?: string; jobId?: string; timing?: unknown };
    if (parsed.jobId === undefined || parsed.timing === undefined) return;
    into.set(parsed.jobId, parsed.timing);
    if (into === gatewayLines && parsed.requestId !== undefined) jobIds.set(parsed.requestId, parsed.jobId);
  };
  const worker = start(
    process.execPath,
    [`${root}apps/worker/dist/main.js`],
    {
      REDIS_URL: redisUrl,
      MODEL_DIR: await ensureBuiltinModel(workload.preset),
      ...workerSettings(workload),
      METRICS_PORT: String(workerPort),
      METRICS_HOST: '127.0.0.1',
      // Info: the per-request line carries the worker's side of the TTFT breakdown.
      LOG_LEVEL: 'info',
    },
    collect(workerLines),
  );
  const port = await freePort();
  await sleep(300);
  const gateway = start(
    process.execPath,
    [`${root}apps/gateway/dist/main.js`],
    {
      REDIS_URL: redisUrl,
      PORT: String(port),
      HOST: '127.0.0.1',
      LOG_LEVEL: 'info',
      REGISTRY_POLL_MS: '200',
    },
    collect(gatewayLines),
  );
  const url = `http://127.0.0.1:${port}`;
  await until('the gateway to see the worker', async () => (await fetch(`${url}/readyz`)).status === 200);
  return {
    url,
    gcPauses: async () => {
      const [gateway, worker] = await Promise.all([readGcPauses(`${url}/metrics`), readGcPauses(`http://127.0.0.1:${workerPort}/metrics`)]);
      return { gateway, worker };
    },
    clearTimings: () => {
      gatewayLines.clear();
      workerLines.clear();
      jobIds.clear();
    },
    ttftBreakdown: async (clients) => {
      /** A request's `request finished` lines from the gateway and the worker (either undefined until it has come). */
      const linesOf = (c: ClientTiming) => {
        const jobId = jobIds.get(c.requestId);
        return jobId === undefined ? {} : { g: gatewayLines.get(jobId), w: workerLines.get(jobId) };
      };
      const logged = (c: ClientTiming) => {
        const { g, w } = linesOf(c);
        return g !== undefined && w !== undefined;
      };
      await until("every request's log lines", async () => clients.every(logged), 5_000).catch(() => undefined);
      const skipped = { noLogLines: 0, missingFields: 0 };
      const rows: number[][] = [];
      const enqueue: number[] = [];
      const addToPickup: number[] = [];
      const engineQueue: number[] = [];
      const checks: number[] = [];
      const heldBack: number[] = [];
      for (const c of clients) {
        const { g, w } = linesOf(c);
        if (g === undefined || w === undefined) {
          skipped.noLogLines++;
          continue;
        }
        const spans = spansOf(g, w, c);
        if (spans === undefined) {
          skipped.missingFields++;
          continue;
        }
        rows.push(spans);
        if (g.enqueuedMs !== undefined) {
          enqueue.push(g.enqueuedMs - g.preparedMs);
          addToPickup.push(w.pickedUpAt - g.receivedAt - g.enqueuedMs);
        }
        engineQueue.push(w.engineQueueMs);
        if (w.checkedMs !== undefined) checks.push(w.checkedMs);
        if (w.checkedMs !== undefined && w.firstStepMs !== undefined && w.checkedMs > w.firstStepMs)
          heldBack.push(w.checkedMs - w.firstStepMs);
      }
      return {
        medianMs: TTFT_SPANS.map((_, i) =>
          round(
            percentile(
              rows.map((r) => r[i]!),
              50,
            ),
          ),
        ),
        p90Ms: TTFT_SPANS.map((_, i) =>
          round(
            percentile(
              rows.map((r) => r[i]!),
              90,
            ),
          ),
        ),
        gatewayEnqueueMs: round(percentile(enqueue, 50)),
        addToPickupMs: round(percentile(addToPickup, 50)),
        engineQueueMs: round(percentile(engineQueue, 50)),
        checksMs: round(percentile(checks, 50)),
        checksHeldBack: { requests: heldBack.length, medianMs: heldBack.length === 0 ? 0 : round(percentile(heldBack, 50)) },
        requests: rows.length,
        skipped,
      };
    },
    stop: async () => {
      await Promise.all([stopChild(gateway), stopChild(worker)]);
      await stopChild(redis);
    },
  };
}

/** The same workload through the gateway, read raw off the SSE stream. */
export async function throughGateway(url: string, workload: LatencyWorkload, samples: LatencySamples): Promise<void> {
  const marker = Buffer.from('"text":"');
  await Promise.all(
    prompts(workload.concurrency).map(async (prompt, i) => {
      await sleep(i * workload.staggerMs);
      const requestId = `bench-${randomUUID()}`;
      const start = performance.now();
      const res = await fetch(`${url}/v1/completions`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', 'X-Request-Id': requestId },
        body: JSON.stringify({
          model: workload.preset,
          prompt,
          max_tokens: workload.maxTokens,
          temperature: 0,
          ignore_eos: true,
          stream: true,
        }),
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
      if (times.length > 0) {
        samples.clients?.push({ requestId, sentAt: performance.timeOrigin + start, firstReadAt: performance.timeOrigin + times[0]! });
      }
    }),
  );
}
