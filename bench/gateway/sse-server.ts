/**
 * One side of the SSE write-path benchmark, run as its own process:
 *
 * - `baseline`: a minimal `node:http` SSE writer, `res.write('data: …\n\n')` per event.
 * - `gateway`: the gateway's real HTTP path — Hono app, routes, request validation, sessions, the
 *   demultiplexer's decode + dispatch, chunk formatting and the SSE writer — fed in process by a driver
 *   that plays the worker: per step it encodes ONE gateway-channel message carrying a delta for every
 *   stream, which the gateway decodes and dispatches exactly as its relay does (no Redis socket).
 *
 * Both start producing when `streams` clients are connected, then emit `warmup + events` steps (one
 * event per stream per step) paced `stepMs` apart, as a worker's decode steps come (0 = as fast as the
 * event loop allows), and end each stream with `[DONE]`. Paced, the load client keeps up and the
 * gateway writes every delta as its own frame, so both sides do the same work per event; unpaced, a
 * client that falls behind makes the gateway coalesce (flow control) and the rates stop being comparable.
 *
 * Two CPU windows per run: the first `warmup` steps (a process that just started: V8 still compiles
 * the hot path on its helper threads and sweeps what the 1,000 requests' intake left), and the
 * `events` steps after them to the last `[DONE]` (the steady state a long-running server is in).
 * Usage: sse-server.ts <baseline|gateway> <streams> <events> [stepMs] [warmup]; prints `port <n>` when
 * listening, and `cpu <µs> cold <µs>` (the two windows' CPU time, all threads) when the last stream closed.
 */
import { randomUUID } from 'node:crypto';
import { createServer, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { serve, type ServerType } from '@hono/node-server';
import { pino } from 'pino';
import { createGatewayMetrics } from '@sluice/metrics';
import { decodeGatewayMessage, encodeEntry, encodeGatewayMessage, liveGatewayMessage, type GatewayEntry } from '@sluice/protocol';
import { createApp } from '../../apps/gateway/dist/app.js';
import { createGatewayObserver } from '../../apps/gateway/dist/gateway-observer.js';
import { loadGatewayConfig } from '../../apps/gateway/dist/config.js';
import { SessionManager } from '../../apps/gateway/dist/session-manager.js';
import { HeartbeatTicker } from '../../apps/gateway/dist/sse-writer.js';

const [mode, streamsArg, eventsArg, stepMsArg = '0', warmupArg = '0'] = process.argv.slice(2);
const streams = Number(streamsArg);
const events = Number(eventsArg);
const stepMs = Number(stepMsArg);
const warmup = Number(warmupArg);
const steps = warmup + events;
const TOKEN = ' token';
/** Waits for step `step`'s start: `stepMs` after the previous one (at once when behind), or one macrotask. */
const tick = (step: number) => {
  const wait = stepMs > 0 ? wallStart + step * stepMs - performance.now() : 0;
  return new Promise<void>((resolve) => (wait > 0 ? setTimeout(resolve, wait) : setImmediate(resolve)));
};

/**
 * CPU time of this process (every thread: V8's compiler and GC helpers count) in the two windows:
 * wall-clock rates on a shared machine move with the neighbours' load, CPU time per event much less.
 */
let open = 0;
let coldStart: NodeJS.CpuUsage | undefined;
let cpuStart: NodeJS.CpuUsage | undefined;
let wallStart = 0;
const micros = (cpu: NodeJS.CpuUsage) => cpu.user + cpu.system;
function track(res: ServerResponse): void {
  open++;
  res.once('close', () => {
    if (--open > 0 || cpuStart === undefined || coldStart === undefined) return;
    const cold = micros(cpuStart) - micros(coldStart);
    process.stdout.write(`cpu ${micros(process.cpuUsage(cpuStart))} cold ${cold}\n`);
  });
}
function productionStarts(): void {
  coldStart = process.cpuUsage();
  wallStart = performance.now();
}
/** Called before step `step` goes out: the measured window starts after the warm-up's steps. */
function beforeStep(step: number): void {
  if (step === warmup) cpuStart = process.cpuUsage();
}

async function baseline(): Promise<number> {
  const streamsOpen: Array<{ res: ServerResponse; head: string }> = [];
  let started = false;
  const created = Math.floor(Date.now() / 1000);
  const server = createServer((req, res) => {
    req.resume();
    res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no' });
    res.flushHeaders();
    // The same bytes per event as the gateway's chunks (a conservative baseline: no per-event JSON.stringify of an object).
    const head = `{"id":"chatcmpl-${randomUUID()}","object":"chat.completion.chunk","created":${created},"model":"bench","choices":[{"index":0,"delta":{"content":`;
    track(res);
    streamsOpen.push({ res, head });
    if (streamsOpen.length === streams && !started) {
      started = true;
      void produce();
    }
  });
  const produce = async () => {
    productionStarts();
    for (let step = 0; step < steps; step++) {
      beforeStep(step);
      for (const { res, head } of streamsOpen)
        res.write(`data: ${head}${JSON.stringify(TOKEN)}},"logprobs":null,"finish_reason":null}]}\n\n`);
      await tick(step + 1);
    }
    for (const { res } of streamsOpen) res.end('data: [DONE]\n\n');
  };
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return (server.address() as AddressInfo).port;
}

async function gateway(): Promise<number> {
  const config = loadGatewayConfig({
    HEADERS_WAIT_MS: '60000',
    IDLE_TIMEOUT_MS: '600000',
    QUEUE_TIMEOUT_MS: '600000',
    MAX_QUEUED_REQUESTS: String(streams + 10),
  });
  const logger = pino({ level: 'warn' });
  const log = {
    read: async () => ({ entries: [], known: false }),
    meta: async () => undefined,
    last: async () => undefined,
    tail: async () => [],
  };
  const sessions = new SessionManager(
    { queueTimeoutMs: config.queueTimeoutMs, idleTimeoutMs: config.idleTimeoutMs },
    { cancel: () => undefined, detach: () => undefined, migrate: async () => ({ outcome: 'gone' as const }) },
    log,
    logger,
  );
  const submitted: string[] = [];
  // What the relay does with every message from Redis: decode (JSON + validation), then dispatch.
  const relay = (entries: GatewayEntry[]) => relayRaw(encodeGatewayMessage({ workerId: 'bench', entries }));
  const relayRaw = (raw: string | Buffer) => sessions.dispatch(decodeGatewayMessage(raw));
  const produce = async () => {
    // The worker's side (encoding each step's message) is done before the clock starts: the
    // measured process should spend its time on the gateway's side only. The messages wait as bytes
    // off the V8 heap, as they arrive from Redis; the relay's decode turns each into a string, as
    // ioredis does (strings built up front were ~20 MB on the heap that every scavenge in the
    // measured window moved, a cost no deployed gateway has).
    // Each entry is what a worker's step router writes (its live form, `encodeEntry`).
    const messages: Buffer[] = [];
    for (let step = 0; step < steps; step++) {
      const live = submitted.map(
        (requestId) =>
          encodeEntry({ type: 'text-delta', index: 0, text: TOKEN, tokens: 1, tokenIds: [1000 + step], requestId, seq: step + 1 }).live,
      );
      messages.push(Buffer.from(liveGatewayMessage('bench', live)));
    }
    productionStarts();
    relay(submitted.map((requestId) => ({ requestId, seq: 0, type: 'accepted', workerId: 'bench', promptTokens: 4 })));
    for (const [step, raw] of messages.entries()) {
      beforeStep(step);
      relayRaw(raw);
      await tick(step + 1);
    }
    relay(
      submitted.flatMap((requestId): GatewayEntry[] => [
        { requestId, seq: steps + 1, type: 'text-end', index: 0, finishReason: 'length' },
        { requestId, seq: steps + 2, type: 'finish', usage: { promptTokens: 4, completionTokens: steps } },
      ]),
    );
  };
  const app = createApp({
    config,
    logger,
    channel: 'bench',
    sessions,
    heartbeats: new HeartbeatTicker(config.heartbeatMs),
    // The metrics a deployed gateway records (apps/gateway/src/main.ts): they run on this hot path too.
    hooks: createGatewayObserver(createGatewayMetrics(), logger),
    jobs: {
      submit: async (job) => {
        submitted.push(job.requestId);
        if (submitted.length === streams) setImmediate(() => void produce());
      },
      attach: async () => undefined,
      jobState: async () => ({ queued: true, cancelled: false }),
      cancelRequest: async () => undefined,
    },
    log,
    registry: { liveWorkerCount: 1, models: () => [], requireModel: (id) => ({ id, maxContextLength: 4096, workers: 1 }) },
    // One token per character: the prompt is counted as a deployed gateway counts it, at no real cost.
    tokenizers: {
      forModel: async () => ({
        maxContextLength: 4096,
        vocabSize: 256,
        encodeChat: (messages) => [...messages.map((m) => m.content).join('\n')].map((ch) => ch.charCodeAt(0) % 256),
        encodeText: (prompt) => [...prompt].map((ch) => ch.charCodeAt(0) % 256),
        decode: (ids) => String.fromCharCode(...ids),
      }),
    },
    checkRedis: async () => true,
    drainPhase: () => 'serving',
  });
  const server = await new Promise<ServerType>((resolve) => {
    const s = serve(
      {
        fetch: (req, env) => {
          track(env.outgoing as ServerResponse);
          return app.fetch(req, env);
        },
        port: 0,
        hostname: '127.0.0.1',
      },
      () => resolve(s),
    );
  });
  return (server.address() as AddressInfo).port;
}

const port = mode === 'gateway' ? await gateway() : await baseline();
process.stdout.write(`port ${port}\n`);
process.on('SIGTERM', () => process.exit(0));
