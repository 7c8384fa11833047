/**
 * `npm run bench:serve`: issue 12's workloads through the whole stack (client → gateway → BullMQ →
 * worker → engine → Redis → gateway → client), side by side with llama.cpp's `llama-server` on the
 * same weights when one is given.
 *
 * Both servers get the same requests from the same client code (`POST /v1/completions`, token-id
 * prompts of 8–26 tokens, greedy, `ignore_eos`, streamed), workload by workload, round by round,
 * each measured workload after one unmeasured 4-token request to the same side (a settle); the
 * sides' order changes from round to round so that over
 * `sideOrderRounds` rounds each side runs in each position, and right after each other side, equally
 * often (`side-order.ts`). Before that, a parity check: how many of 12 text prompts each
 * server tokenizes to the same ids, and completes greedily (128 tokens, stopping at EOS, whole
 * answers) with the same text.
 *
 * Env:
 * - `LLAMA_SERVER`: path of a `llama-server` binary (llama.cpp). Without it only Sluice runs.
 * - `LLAMA_ARGS`: extra arguments for it (default none: its defaults, flash attention auto, f16 KV;
 *   e.g. `-fa off -ctk f32 -ctv f32` for Sluice's numerics).
 * - `BENCH_PRESET`: the generated model (`bench`, default; `tiny`, `smollm2-135m`).
 * - `BENCH_ROUNDS` (default 2), `BENCH_WORKLOADS` (default `32x128,32x768,1x128`), `BENCH_THREADS`
 *   (both servers' threads; default 2, this machine's cores).
 * - `BENCH_ONE_STREAM_REQUESTS` (default 5, as bench:engine): a one-stream workload sends this many
 *   requests one after another in each round (a lone 128-token stream is ~0.6 s, which one scheduling
 *   hiccup of a shared VM swung by ±30 %); a burst workload sends one request per stream.
 * - `BENCH_WRITE_DOCS=0`: print only (default: write docs/benchmarks.md and bench-results/serve.json).
 * - `BENCH_IN_PROCESS=1`: also the engine alone in this process (the worker's options, SLUICE_ENV
 *   included; same prompts; no HTTP, no Redis), in the same rounds: what the stack adds per workload,
 *   and (the model time of a decode step, read off the worker's metrics and the engine's step stats)
 *   how much of that is the model call itself running slower beside the other processes.
 * - `SLUICE_ENV='{"NAME":"value"}'`: settings over the Sluice worker's defaults (e.g. `INTRA_OP_THREADS`).
 * - `SLUICE_B_ENV='{"NAME":"value"}'`: also a second Sluice stack whose worker gets these settings
 *   over the first's, in the same rounds: an A/B of worker settings.
 * - `BENCH_BAN_EOS=0`: Sluice's workload requests without a −100 `logit_bias` on the model's EOS ids. By
 *   default they carry one, because the two servers' `ignore_eos` differ: llama-server bans every
 *   end-of-generation token (a −∞ logit bias), Sluice (vLLM's meaning) samples it and goes on, and an
 *   EOS it samples has no text — a greedy stream of this model can open with 15–19 of them, which the
 *   client sees as a late first token and long gaps. With the ban both servers generate the same kind of
 *   tokens.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createEngine, type Engine } from '@sluice/engine';
import { ensureBuiltinModel, loadModelDir, writeTinyModelGguf } from '@sluice/model';
import { TINY_MODEL_PRESETS } from '../../packages/model/src/tiny-model/presets.js';
import { writeSection } from '../../packages/engine/bench/docs-section.js';
import { ONE_STREAM_REQUESTS, runStreams, type PeerWorkload, type WorkloadResult } from '../../packages/engine/bench/peer-workloads.js';
import { Cluster } from '../../test/support/cluster.js';
import { freePort } from '../../test/support/processes.js';
import { scrapePrometheus } from '../../test/support/prometheus.js';
import { median, percentile, round } from '../gateway/stats.js';
import { engineOptions, loadWorkerConfig } from '../../apps/worker/dist/config.js';
import { startLlamaServer, type PeerServer } from './llama-server.js';
import { ownCpu, processCpu } from './process-cpu.js';
import { sideOrder, sideOrderRounds } from './side-order.js';
import { streamCompletion, type StreamedCompletion } from './stream-client.js';

const root = fileURLToPath(new URL('../..', import.meta.url));
const log = (message: string) => process.stderr.write(`[bench:serve] ${message}\n`);

const preset = (process.env.BENCH_PRESET ?? 'bench') as keyof typeof TINY_MODEL_PRESETS;
if (!Object.hasOwn(TINY_MODEL_PRESETS, preset))
  throw new Error(`BENCH_PRESET must be one of ${Object.keys(TINY_MODEL_PRESETS).join(', ')}`);
const arch = TINY_MODEL_PRESETS[preset];
const rounds = Number(process.env.BENCH_ROUNDS ?? 2);
const threads = Number(process.env.BENCH_THREADS ?? 2);
/** Requests one after another per round in a one-stream workload. */
const oneStreamRequests = Number(process.env.BENCH_ONE_STREAM_REQUESTS ?? ONE_STREAM_REQUESTS);
if (!Number.isInteger(oneStreamRequests) || oneStreamRequests < 1) throw new Error('BENCH_ONE_STREAM_REQUESTS must be a whole number ≥ 1');
const workloadNames = (process.env.BENCH_WORKLOADS ?? '32x128,32x768,1x128').split(',');
const workloads: PeerWorkload[] = workloadNames.map((name) => {
  const match = /^(\d+)x(\d+)$/.exec(name);
  if (match === null) throw new Error(`BENCH_WORKLOADS: ${name} is not <streams>x<tokens>`);
  const streams = Number(match[1]);
  return { name, streams, tokens: Number(match[2]), requests: streams === 1 ? oneStreamRequests : 1 };
});
const llamaBinary = process.env.LLAMA_SERVER;
const llamaArgs = (process.env.LLAMA_ARGS ?? '').split(/\s+/).filter((arg) => arg !== '');
const writeDocs = process.env.BENCH_WRITE_DOCS !== '0';
/** Settings over the Sluice worker's defaults (`SLUICE_ENV='{"NAME":"value"}'`). */
const sluiceEnv = JSON.parse(process.env.SLUICE_ENV ?? '{}') as Record<string, string>;
/** Also run the engine alone in this process (`BENCH_IN_PROCESS=1`): the reference for what the stack adds. */
const inProcess = process.env.BENCH_IN_PROCESS === '1';
const banEos = process.env.BENCH_BAN_EOS !== '0';
/** A second Sluice stack whose worker gets these env settings over the first's: an A/B of worker settings in one run. */
const sluiceBEnv = process.env.SLUICE_B_ENV === undefined ? undefined : (JSON.parse(process.env.SLUICE_B_ENV) as Record<string, string>);
/** Rows of the worker's batch and slots of the peer: at least 32, as issue 12 measured. */
const slots = Math.max(32, ...workloads.map((w) => w.streams));
/** Names this run's docs section and results file: `serve`, or `serve-<preset>-<llama args>` when they differ from the defaults. */
const variant = ['serve', preset === 'bench' ? '' : preset, llamaArgs.join('_').replace(/-/g, '')].filter((part) => part !== '').join('-');

interface Side {
  name: 'sluice' | 'sluice-b' | 'llama.cpp' | 'engine';
  /** The server's base URL ('' for the engine in process). */
  url: string;
  /** Extra request fields this server needs. */
  extra: Record<string, unknown>;
  /** One streamed greedy completion of `prompt` (token ids), `tokens` long, ignoring EOS. */
  stream(prompt: number[], tokens: number): Promise<StreamedCompletion>;
  /** CPU seconds so far of each part of this side's stack (the load client included). */
  cpu(): Record<string, number>;
  /** Sluice's sides: the model time of its decode-only steps so far (session.run, summed), and their count. */
  decodeSteps?(): Promise<DecodeSteps>;
}

/** Decode-only engine steps (no prompt in them) and the time their model calls took, cumulative. */
interface DecodeSteps {
  modelSeconds: number;
  steps: number;
}

interface RoundResult {
  tokensPerSecond: number;
  ttftMs: number[];
  /**
   * Request sent → second text chunk read, per stream. It holds the wait for a step's other prefills
   * whether a server sends a burst's first tokens as each prefill call ends (the wait then counts in
   * the stream's first ITL gap) or when the step ends (then in its TTFT).
   */
  secondMs: number[];
  itlMs: number[];
  /** Per gap of `itlMs`: whether it began before the round's last first text (the burst's ramp-up, prompts still being prefilled). */
  itlInRampUp: boolean[];
  /** CPU µs per completion token, by part of the stack. */
  cpuUsPerToken: Record<string, number>;
  /** Mean model time (ms) of the round's decode-only steps, where the side reports it. */
  decodeStepModelMs?: number;
}

/** N streams at once, each prompt's ids as the prompt, `tokens` tokens each, `requests` one after another per stream. */
async function runWorkload(side: Side, workload: PeerWorkload, round: number): Promise<RoundResult> {
  const decodeBefore = await side.decodeSteps?.();
  const cpuBefore = side.cpu();
  const started = performance.now();
  const bySlot = await runStreams(workload, arch.vocabSize, 1000 + round, (prompt) => side.stream(prompt, workload.tokens));
  const wallMs = performance.now() - started;
  const cpuAfter = side.cpu();
  const decodeAfter = await side.decodeSteps?.();
  const streams = bySlot.flat();
  const tokens = streams.length * workload.tokens;
  const cpuUsPerToken = Object.fromEntries(
    Object.entries(cpuAfter).map(([part, seconds]) => [part, ((seconds - (cpuBefore[part] ?? 0)) * 1e6) / tokens]),
  );
  const result: RoundResult = {
    tokensPerSecond: tokens / (wallMs / 1000),
    ttftMs: [],
    secondMs: [],
    itlMs: [],
    itlInRampUp: [],
    cpuUsPerToken,
  };
  if (decodeBefore !== undefined && decodeAfter !== undefined && decodeAfter.steps > decodeBefore.steps) {
    result.decodeStepModelMs = ((decodeAfter.modelSeconds - decodeBefore.modelSeconds) * 1000) / (decodeAfter.steps - decodeBefore.steps);
  }
  // The burst's ramp-up: until each stream's first request had its first text.
  const rampUpEnd = Math.max(...bySlot.map(([first]) => first?.textAt[0] ?? -Infinity));
  for (const stream of streams) {
    if (stream.finishReason !== 'length') throw new Error(`${side.name}: a ${workload.name} stream ended with ${stream.finishReason}`);
    const [first] = stream.textAt;
    if (first === undefined) continue;
    result.ttftMs.push(first - stream.sentAt);
    if (stream.textAt[1] !== undefined) result.secondMs.push(stream.textAt[1] - stream.sentAt);
    for (let i = 1; i < stream.textAt.length; i++) {
      result.itlMs.push(stream.textAt[i]! - stream.textAt[i - 1]!);
      result.itlInRampUp.push(stream.textAt[i - 1]! < rampUpEnd);
    }
  }
  return result;
}

/** A side's `stream` over HTTP: the same client code for every server. */
function httpStream(url: string, extra: Record<string, unknown>): Side['stream'] {
  return (prompt, tokens) =>
    streamCompletion(url, { model: preset, prompt, max_tokens: tokens, temperature: 0, ignore_eos: true, ...extra });
}

/**
 * The engine alone, in this process (its own engine thread, as the worker runs it): what the stack
 * adds is the difference. Timed like a client: when each non-empty text delta reaches this thread.
 */
function engineStream(engine: Engine, logitBias: Array<[number, number]>): Side['stream'] {
  let next = 0;
  return async (promptTokenIds, tokens) => {
    const result: StreamedCompletion = { sentAt: performance.now(), textAt: [], text: '', finishReason: null };
    const events = engine.generate({
      id: `bench-serve-${next++}`,
      promptTokenIds,
      sampling: { maxTokens: tokens, temperature: 0, ignoreEos: true, logitBias },
    });
    for await (const event of events) {
      if (event.type === 'text-delta' && event.text !== '') {
        result.textAt.push(performance.now());
        result.text += event.text;
      } else if (event.type === 'text-end') result.finishReason = event.finishReason;
      else if (event.type === 'finish' && event.error !== undefined) throw new Error(`engine: ${event.error.message}`);
    }
    return result;
  };
}

/** Text prompts of the parity check (each server tokenizes them itself). */
const PARITY_PROMPTS = [
  'Once upon a time, in a land far away, there lived',
  'The river ran past the mill and',
  'In the morning the fishermen',
  'She opened the old wooden box and found',
  'The train left the station at',
  'Why is the sky blue? Because',
  'A list of things to bring: bread, cheese,',
  'He said that the weather would',
  'The city was quiet after the storm, and',
  'Numbers: 1, 2, 3, 4,',
  'The garden behind the house had',
  'When the bell rang, the children',
];

interface Parity {
  prompts: number;
  sameIds: number;
  sameText: number;
  /** The first prompt that differed, for the record. */
  firstDifference?: { prompt: string; sluice: string; peer: string };
}

/** POSTs JSON to one of the servers and returns its JSON answer. */
async function postJson<T>(side: Side, path: string, body: unknown): Promise<T> {
  const res = await fetch(`${side.url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  if (!res.ok) throw new Error(`${side.name} ${path}: HTTP ${res.status} ${await res.text()}`);
  return (await res.json()) as T;
}

async function tokenize(side: Side, text: string): Promise<number[]> {
  const body = side.name === 'sluice' ? { model: preset, prompt: text } : { content: text };
  return (await postJson<{ tokens: number[] }>(side, '/tokenize', body)).tokens;
}

/** A whole (not streamed) greedy completion: llama-server's stream drops an unfinished UTF-8 tail that its whole answer keeps. */
async function complete(side: Side, prompt: string): Promise<{ text: string; finishReason: string }> {
  const body = { model: preset, prompt, max_tokens: 128, temperature: 0, ...side.extra };
  const { choices } = await postJson<{ choices: Array<{ text: string; finish_reason: string }> }>(side, '/v1/completions', body);
  return { text: choices[0]!.text, finishReason: choices[0]!.finish_reason };
}

async function parityCheck(sluice: Side, peer: Side): Promise<Parity> {
  const parity: Parity = { prompts: PARITY_PROMPTS.length, sameIds: 0, sameText: 0 };
  for (const prompt of PARITY_PROMPTS) {
    const [a, b] = await Promise.all([tokenize(sluice, prompt), tokenize(peer, prompt)]);
    if (JSON.stringify(a) === JSON.stringify(b)) parity.sameIds++;
    const [x, y] = await Promise.all([complete(sluice, prompt), complete(peer, prompt)]);
    if (x.text === y.text && x.finishReason === y.finishReason) parity.sameText++;
    else parity.firstDifference ??= { prompt, sluice: x.text, peer: y.text };
  }
  return parity;
}

/** A workload's figures as bench:engine reports them, plus where the CPU went. */
type Summary = Pick<WorkloadResult, 'tokensPerSecond' | 'tokensPerSecondRounds' | 'ttftP50Ms' | 'ttftP99Ms' | 'itlP50Ms' | 'itlP99Ms'> & {
  /** Median over rounds of CPU µs per token, by part of the stack. */
  cpuUsPerToken: Record<string, number>;
  /** The slowest first token of each round (ms): which rounds set the pooled TTFT p99. */
  ttftMaxRoundsMs: number[];
  /** Request sent → second text chunk, over every stream of every round (ms). */
  secondP50Ms: number;
  secondP99Ms: number;
  /** The ITL gaps at or above the p99 (all rounds), and how many of them began in a burst's ramp-up. */
  itlTail: { gaps: number; inRampUp: number };
  /** Median over rounds of the mean model time of a decode-only step (ms), where the side reports it. */
  decodeStepModelMs?: number;
};

function summarize(results: RoundResult[]): Summary {
  const ttft = results.flatMap((r) => r.ttftMs);
  const second = results.flatMap((r) => r.secondMs);
  const itl = results.flatMap((r) => r.itlMs);
  const inRampUp = results.flatMap((r) => r.itlInRampUp);
  const p99 = percentile(itl, 99);
  const tail = itl.flatMap((gap, i) => (gap >= p99 ? [inRampUp[i]!] : []));
  return {
    tokensPerSecond: round(median(results.map((r) => r.tokensPerSecond)), 1),
    tokensPerSecondRounds: results.map((r) => round(r.tokensPerSecond, 1)),
    ttftP50Ms: round(percentile(ttft, 50), 1),
    ttftP99Ms: round(percentile(ttft, 99), 1),
    ttftMaxRoundsMs: results.map((r) => round(Math.max(...r.ttftMs), 1)),
    itlP50Ms: round(percentile(itl, 50), 1),
    itlP99Ms: round(percentile(itl, 99), 1),
    secondP50Ms: round(percentile(second, 50), 1),
    secondP99Ms: round(percentile(second, 99), 1),
    cpuUsPerToken: Object.fromEntries(
      Object.keys(results[0]?.cpuUsPerToken ?? {}).map((part) => [part, Math.round(median(results.map((r) => r.cpuUsPerToken[part]!)))]),
    ),
    itlTail: { gaps: tail.length, inRampUp: tail.filter(Boolean).length },
    ...(results.every((r) => r.decodeStepModelMs !== undefined)
      ? { decodeStepModelMs: round(median(results.map((r) => r.decodeStepModelMs!)), 2) }
      : {}),
  };
}

/** A Sluice worker's settings in this benchmark, `env` over them (the in-process engine reads the same). */
function workerEnv(modelDir: string, env: Record<string, string>): Record<string, string> {
  return {
    MODEL_DIR: modelDir,
    MODEL_ID: preset,
    MAX_BATCH_SIZE: String(slots),
    KV_PREALLOCATE: 'true',
    ...(threads === cpus().length ? {} : { INTRA_OP_THREADS: String(threads) }),
    HEALTH_REQUEST_IDS: 'false',
    ...env,
  };
}

/**
 * One Sluice stack (redis-server, a worker, a gateway) as a side: the worker as bench:engine runs the
 * engine (batch of `slots`, KV cache reserved at start as the peer reserves its context, the
 * worker's default threads), plus `env` over that.
 */
async function startSluice(
  name: Side['name'],
  modelDir: string,
  env: Record<string, string>,
  streamExtra: Record<string, unknown>,
): Promise<{ side: Side; cluster: Cluster }> {
  const cluster = await Cluster.start();
  try {
    const worker = await cluster.worker(workerEnv(modelDir, env));
    const gateway = await cluster.gateway();
    const workerMetrics = worker.healthUrl.replace(/\/healthz$/, '/metrics');
    const side: Side = {
      name,
      url: gateway.url,
      extra: {},
      stream: httpStream(gateway.url, streamExtra),
      cpu: () => {
        const w = processCpu(worker.process.pid);
        return {
          'worker: engine (model threads)': w.total - w.mainThread,
          'worker: host (main thread)': w.mainThread,
          gateway: processCpu(gateway.process.pid).total,
          'redis-server': processCpu(cluster.redis.process.pid).total,
          client: ownCpu(),
        };
      },
      decodeSteps: async () => {
        const run = (await scrapePrometheus(workerMetrics)).histogram('sluice_worker_model_run_seconds', { phase: 'decode' });
        return { modelSeconds: run.sum, steps: run.count };
      },
    };
    return { side, cluster };
  } catch (error) {
    await cluster.stop();
    throw error;
  }
}

async function main(): Promise<void> {
  const loadBefore = loadavg()[0]!;
  const modelDir = await ensureBuiltinModel(preset);
  // What llama-server's ignore_eos does (see BENCH_BAN_EOS above), asked of Sluice with logit_bias.
  const eosBias: Array<[number, number]> = banEos ? (await loadModelDir(modelDir)).generation.eosTokenIds.map((id) => [id, -100]) : [];
  const streamExtra = eosBias.length === 0 ? {} : { logit_bias: Object.fromEntries(eosBias.map(([id, bias]) => [String(id), bias])) };
  log(
    eosBias.length === 0
      ? "Sluice's workload requests: ignore_eos (EOS sampled, no text)"
      : `Sluice's workload requests: ignore_eos + logit_bias ${JSON.stringify(streamExtra)} (llama-server's ignore_eos bans EOS)`,
  );
  const clusters: Cluster[] = [];
  let engine: Engine | undefined;
  let peer: PeerServer | undefined;
  let scratch: string | undefined;
  try {
    const sluice = await startSluice('sluice', modelDir, sluiceEnv, streamExtra);
    clusters.push(sluice.cluster);
    const sides: Side[] = [sluice.side];
    if (sluiceBEnv !== undefined) {
      const b = await startSluice('sluice-b', modelDir, { ...sluiceEnv, ...sluiceBEnv }, streamExtra);
      clusters.push(b.cluster);
      sides.push(b.side);
      log(`sluice-b: the worker with ${JSON.stringify(sluiceBEnv)}`);
    }
    if (inProcess) {
      // The worker's own options (its defaults, this benchmark's settings and SLUICE_ENV): spinning during a call, etc.
      engine = await createEngine(engineOptions(loadWorkerConfig(workerEnv(modelDir, sluiceEnv)), modelDir));
      // The same decode-only steps the worker's sluice_worker_model_run_seconds{phase="decode"} counts.
      const decode: DecodeSteps = { modelSeconds: 0, steps: 0 };
      engine.onStep((stats) => {
        if (stats.phase !== 'decode') return;
        decode.modelSeconds += stats.modelMs / 1000;
        decode.steps += 1;
      });
      sides.push({
        name: 'engine',
        url: '',
        extra: {},
        stream: engineStream(engine, eosBias),
        cpu: () => ({ 'engine thread + its host (the bench process)': ownCpu() }),
        decodeSteps: async () => ({ ...decode }),
      });
    }
    let parity: Parity | undefined;
    if (llamaBinary !== undefined) {
      scratch = await mkdtemp(join(tmpdir(), 'sluice-bench-serve-'));
      const gguf = join(scratch, `${preset}.gguf`);
      await writeTinyModelGguf(gguf, preset);
      peer = await startLlamaServer({
        binary: llamaBinary,
        gguf,
        port: await freePort(),
        slots,
        // Each slot holds the model's whole context, as Sluice reserves prompt + max_tokens per row.
        contextTokens: slots * arch.maxPositionEmbeddings,
        threads,
        extraArgs: llamaArgs,
      });
      log(`llama-server ${peer.version} on ${peer.url} ${llamaArgs.join(' ')}; sluice on ${sluice.side.url}`);
      // No prompt cache: Sluice has no prefix cache, and rounds reuse prompts across sides.
      const llamaPid = peer.pid;
      const llama: Side = {
        name: 'llama.cpp',
        url: peer.url,
        extra: { cache_prompt: false },
        stream: httpStream(peer.url, { cache_prompt: false }),
        cpu: () => ({ 'llama-server': processCpu(llamaPid).total, client: ownCpu() }),
      };
      sides.push(llama);
      parity = await parityCheck(sluice.side, llama);
      log(`parity: ${JSON.stringify(parity)}`);
    }

    const balancedAfter = sideOrderRounds(sides.length);
    if (rounds % balancedAfter !== 0)
      log(
        `side order: ${rounds} rounds do not balance ${sides.length} sides' positions and predecessors (a multiple of ${balancedAfter} does)`,
      );
    // Warm-up: one short burst per side (first requests, allocator, JIT).
    for (const side of sides) await runWorkload(side, { name: 'warm-up', streams: slots, tokens: 16 }, -1);

    const results = new Map<string, RoundResult[]>();
    for (let r = 0; r < rounds; r++) {
      for (const workload of workloads) {
        for (const side of sideOrder(sides, r)) {
          // Settle: one short request, not measured, before each measured workload, both sides alike.
          // What a server does once after a burst is then not counted in the next workload: after the
          // 32-stream workloads llama-server answered the next lone request 137–874 ms late (stop 41).
          await runWorkload(side, { name: 'settle', streams: 1, tokens: 4 }, -1);
          const result = await runWorkload(side, workload, r);
          const key = `${side.name} ${workload.name}`;
          results.set(key, [...(results.get(key) ?? []), result]);
          log(`round ${r + 1}/${rounds} ${key}: ${result.tokensPerSecond.toFixed(1)} tok/s`);
        }
      }
    }

    const summaries = Object.fromEntries(
      sides.map((side) => [
        side.name,
        Object.fromEntries(workloads.map((w) => [w.name, summarize(results.get(`${side.name} ${w.name}`)!)])),
      ]),
    ) as Record<string, Record<string, Summary>>;
    const report = {
      date: new Date().toISOString(),
      machine: `${cpus()[0]?.model ?? 'cpu'}, ${cpus().length} cores`,
      node: process.version,
      preset,
      rounds,
      threads,
      peer: peer === undefined ? null : { version: peer.version, args: llamaArgs },
      loadAverage: { before: round(loadBefore, 1), after: round(loadavg()[0]!, 1) },
      parity,
      summaries,
    };
    const table = renderTable(report.summaries, sides);
    process.stdout.write(`${table}\n`);
    if (writeDocs) await write(report, table);
  } catch (error) {
    if (peer !== undefined) log(`llama-server's log ends:\n${peer.logTail()}`);
    throw error;
  } finally {
    await peer?.stop();
    for (const cluster of clusters) await cluster.stop();
    await engine?.close();
    if (scratch !== undefined) await rm(scratch, { recursive: true, force: true });
  }
}

/** The median over rounds of `a ÷ b` in the same round (rounds in order on both sides). */
function pairedRatio(a: Summary, b: Summary): number {
  const n = Math.min(a.tokensPerSecondRounds.length, b.tokensPerSecondRounds.length);
  return median(Array.from({ length: n }, (_, i) => a.tokensPerSecondRounds[i]! / b.tokensPerSecondRounds[i]!));
}

function renderTable(summaries: Record<string, Record<string, Summary>>, sides: Side[]): string {
  const sluice = summaries.sluice!;
  const peer = summaries['llama.cpp'];
  /** `<workload> <side> <figure>, …; …` over every workload and side. */
  const bySide = (figure: (summary: Summary) => string) =>
    workloads
      .map((w) => `${w.name} ${sides.map((side) => `${side.name} ${figure(summaries[side.name]![w.name]!)}`).join(', ')}`)
      .join('; ');
  const rows = workloads.map((w) => {
    const s = sluice[w.name]!;
    const p = peer?.[w.name];
    const cell = (value: number | undefined) => (value === undefined ? '—' : String(value));
    const ratio = p === undefined ? '—' : `${(s.tokensPerSecond / p.tokensPerSecond).toFixed(2)}×`;
    const paired = p === undefined ? '—' : `${pairedRatio(s, p).toFixed(2)}×`;
    return (
      `| ${w.streams} × ${w.tokens} | ${s.tokensPerSecond} | ${cell(p?.tokensPerSecond)} | **${ratio}** | ${paired} | ` +
      `${s.ttftP50Ms} / ${s.ttftP99Ms} | ${p === undefined ? '—' : `${p.ttftP50Ms} / ${p.ttftP99Ms}`} | ` +
      `${s.itlP50Ms} / ${s.itlP99Ms} | ${p === undefined ? '—' : `${p.itlP50Ms} / ${p.itlP99Ms}`} | ` +
      `${s.tokensPerSecondRounds.join(' / ')} | ${p === undefined ? '—' : p.tokensPerSecondRounds.join(' / ')} |`
    );
  });
  const contextRatio = (side: Record<string, Summary> | undefined) => {
    const short = side?.['32x128'];
    const long = side?.['32x768'];
    if (short === undefined || long === undefined) return '—';
    return `**${(long.tokensPerSecond / short.tokensPerSecond).toFixed(2)}** (round by round ${pairedRatio(long, short).toFixed(2)})`;
  };
  const others = sides.filter((side) => side.name === 'sluice-b' || side.name === 'engine');
  const otherLabel = (name: Side['name']) =>
    name === 'engine'
      ? 'engine alone (in the bench process, no HTTP, no Redis)'
      : `Sluice B (worker env \`${JSON.stringify(sluiceBEnv)}\`)`;
  const otherRows =
    others.length === 0
      ? []
      : [
          '',
          'Other sides, in the same rounds:',
          '',
          '| workload | side | tok/s | ÷ Sluice | ÷ llama.cpp | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | tok/s per round |',
          '|---|---|---:|---:|---:|---:|---:|---:|',
          ...workloads.flatMap((w) =>
            others.map((side) => {
              const x = summaries[side.name]![w.name]!;
              const p = peer?.[w.name];
              return (
                `| ${w.streams} × ${w.tokens} | ${otherLabel(side.name)} | ${x.tokensPerSecond} | ${(x.tokensPerSecond / sluice[w.name]!.tokensPerSecond).toFixed(2)}× | ` +
                `${p === undefined ? '—' : `${(x.tokensPerSecond / p.tokensPerSecond).toFixed(2)}×`} | ${x.ttftP50Ms} / ${x.ttftP99Ms} | ${x.itlP50Ms} / ${x.itlP99Ms} | ${x.tokensPerSecondRounds.join(' / ')} |`
              );
            }),
          ),
        ];
  const cpuRows = workloads.flatMap((w) =>
    sides.map((side) => {
      const parts = summaries[side.name]![w.name]!.cpuUsPerToken;
      const total = Object.entries(parts)
        .filter(([part]) => part !== 'client')
        .reduce((sum, [, us]) => sum + us, 0);
      const list = Object.entries(parts)
        .map(([part, us]) => `${part} ${us}`)
        .join(', ');
      return `| ${w.streams} × ${w.tokens} | ${side.name} | ${total} | ${list} |`;
    }),
  );
  const timed = sides.filter((side) => side.decodeSteps !== undefined);
  const engineAlone = summaries.engine;
  const decodeRows = workloads.flatMap((w) =>
    timed.map((side) => {
      const ms = summaries[side.name]![w.name]!.decodeStepModelMs;
      const alone = engineAlone?.[w.name]?.decodeStepModelMs;
      const ratio = ms === undefined || alone === undefined || side.name === 'engine' ? '—' : `${(ms / alone).toFixed(2)}×`;
      return `| ${w.streams} × ${w.tokens} | ${side.name} | ${ms ?? '—'} | ${ratio} |`;
    }),
  );
  const decodeTable =
    timed.length === 0
      ? []
      : [
          '',
          "Model time of a decode-only step (no prompt in it), ms: the mean per round (session.run, from the worker's " +
            '`sluice_worker_model_run_seconds{phase="decode"}`, or the engine\'s own step stats in process), median over rounds. ' +
            'The same call through the stack and alone: what the other processes on the same cores cost the model itself.',
          '',
          '| workload | side | model ms per decode step | ÷ engine alone |',
          '|---|---|---:|---:|',
          ...decodeRows,
        ];
  return [
    '| workload | Sluice tok/s | llama.cpp tok/s | Sluice ÷ llama.cpp | the same, round by round (median) | Sluice TTFT p50 / p99 (ms) | llama.cpp TTFT p50 / p99 | Sluice ITL p50 / p99 (ms) | llama.cpp ITL p50 / p99 | Sluice tok/s per round | llama.cpp tok/s per round |',
    '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
    ...rows,
    '',
    '"Sluice ÷ llama.cpp" divides the two medians; "round by round" is the median of each round\'s own ratio, the two sides ' +
      'measured one after the other within the round: on a VM whose speed drifts between rounds, the steadier of the two.',
    '',
    `Throughput at 768 tokens ÷ at 128 tokens (32 streams): Sluice ${contextRatio(sluice)}` +
      (peer === undefined ? '' : `, llama.cpp ${contextRatio(peer)}`) +
      others.map((side) => `, ${side.name} ${contextRatio(summaries[side.name])}`).join('') +
      ' (issue 12 target for Sluice: ≥ 0.95).',
    ...otherRows,
    '',
    "Where each side's ITL tail is: of the gaps at or above its p99 (every round), how many began in the burst's ramp-up " +
      "(before the round's last stream had its first text, while prompts were still being prefilled): " +
      bySide(({ itlTail }) => `${itlTail.inRampUp} of ${itlTail.gaps}`) +
      '.',
    '',
    'The slowest first token of each round, ms (the TTFT p99 pools every round: a slow round sets it): ' +
      bySide(({ ttftMaxRoundsMs }) => ttftMaxRoundsMs.join(' / ')) +
      '.',
    '',
    "Request sent → second text chunk read, p50 / p99 ms (every stream of every round): a side that sends a burst's first tokens as each prefill call ends counts " +
      "the wait for the step's other prefills in its first ITL gap, one that sends them when the step ends counts it in TTFT; the second token's time holds it either way: " +
      bySide(({ secondP50Ms, secondP99Ms }) => `${secondP50Ms} / ${secondP99Ms}`) +
      '.',
    '',
    'CPU time per completion token, µs (median over rounds; from /proc, all threads of each process; the load client is the same code for both sides):',
    '',
    '| workload | server | server CPU per token | by part |',
    '|---|---|---:|---|',
    ...cpuRows,
    ...decodeTable,
  ].join('\n');
}

async function write(report: Record<string, unknown> & { parity: Parity | undefined; peer: unknown }, table: string): Promise<void> {
  await writeFile(`${root}bench-results/${variant}.json`, `${JSON.stringify(report, null, 2)}\n`);
  const parity = report.parity;
  const peer = report.peer as { version: string; args: string[] } | null;
  const section = [
    `## Through the whole stack, side by side with llama.cpp (\`npm run bench:serve\`${preset === 'bench' ? '' : `, BENCH_PRESET=${preset}`}${llamaArgs.length === 0 ? '' : `, LLAMA_ARGS="${llamaArgs.join(' ')}"`})`,
    '',
    `Measured ${String(report.date)} on ${String(report.machine)}, Node ${process.version}; 1-minute load average ${JSON.stringify(report.loadAverage)}.`,
    `Model: the generated \`${preset}\` preset (${arch.numLayers} layers, hidden ${arch.hiddenSize}, ${arch.numHeads} heads / ${arch.numKvHeads} KV heads, vocab ${arch.vocabSize}, float32).`,
    `Sluice: one gateway, one worker (MAX_BATCH_SIZE ${slots}, KV_PREALLOCATE, ${Object.keys(sluiceEnv).length === 0 ? "the worker's default threads: one onnxruntime intra-op thread per physical core, spinning only during a call" : `\`${JSON.stringify(sluiceEnv)}\``}), redis-server, as processes on loopback. ` +
      (peer === null
        ? 'No peer ran (set `LLAMA_SERVER` to a llama-server binary).'
        : `Peer: llama.cpp \`llama-server\` (${peer.version}) on a GGUF file of the same weights (\`npm run model:generate -- --preset ${preset} --format gguf\`), ` +
          `${slots} slots, the model's context per slot, ${threads} threads, ${peer.args.length === 0 ? 'its defaults (flash attention auto, f16 KV cache)' : `\`${peer.args.join(' ')}\``}, \`cache_prompt: false\`.`),
    parity === undefined
      ? ''
      : `Parity first: of ${parity.prompts} text prompts, each server's tokenizer gave the same ids for ${parity.sameIds}, and whole greedy completions (128 tokens, stopping at EOS) had the same text and finish reason for ${parity.sameText}.`,
    '',
    `Each workload: N streams submitted at once by one client process (\`fetch\`, \`POST /v1/completions\`, token-id prompts of 8–26 tokens, greedy, \`ignore_eos\`${banEos ? " (Sluice's requests also with a −100 `logit_bias` on the model's EOS ids, which llama-server's `ignore_eos` bans)" : ''}, streamed; a one-stream workload sends ${oneStreamRequests} requests one after another in each round); ${rounds} rounds, workloads in turn, the sides' order changing by round (a Williams design: over 2 rounds for two sides, 6 for three, 4 for four, each side runs in each position, and right after each other side, equally often), each measured workload after one unmeasured 4-token request to the same side (a settle: what a server does once after a burst is not counted in the next workload). tok/s: all completion tokens ÷ first request sent → last stream ended, median over rounds (nearest rank: of two rounds, the lower); TTFT (request sent → first text chunk read) and ITL (gaps between a stream's text chunks) over every stream of every round.`,
    '',
    table,
    '',
    `Raw figures: \`bench-results/${variant}.json\` (written by \`npm run bench:serve\`).`,
  ].join('\n');
  await writeSection(`${root}docs/benchmarks.md`, section, variant);
  log(`wrote docs/benchmarks.md and bench-results/${variant}.json`);
}

await main();
