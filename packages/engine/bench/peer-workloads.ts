/**
 * The three workloads of the llama.cpp comparison (issue 12): N concurrent streams × T tokens, all
 * submitted at once, prompts of 8–26 tokens, greedy, ignore_eos; the one-stream workload sends
 * `ONE_STREAM_REQUESTS` requests one after another (one 128-token stream is ~0.6 s, too short for a
 * shared VM's swings).
 * Per workload: tokens/s (all
 * completion tokens over the wall time from the first submission to the last finish), TTFT
 * (submission → first token event on the host thread) and ITL (gaps between a stream's
 * consecutive token events), p50 and p99 over every stream of every round.
 */
import type { Engine } from '../src/index.js';
import { median, percentile } from './raw-session.js';

export interface PeerWorkload {
  name: string;
  streams: number;
  tokens: number;
  /** Requests each stream sends one after another in a round (default 1). */
  requests?: number;
}

/** Requests the one-stream workload sends one after another in a round. */
export const ONE_STREAM_REQUESTS = 5;

export const PEER_WORKLOADS: readonly PeerWorkload[] = [
  { name: '32x128', streams: 32, tokens: 128 },
  { name: '32x768', streams: 32, tokens: 768 },
  { name: '1x128', streams: 1, tokens: 128, requests: ONE_STREAM_REQUESTS },
];

/** llama.cpp's llama-server on the same weights and machine kind (issue 12). */
export const PEER_FIGURES: Readonly<Record<string, { tokensPerSecond: number; itlP99Ms?: number }>> = {
  '32x128': { tokensPerSecond: 1189, itlP99Ms: 40.5 },
  '32x768': { tokensPerSecond: 987, itlP99Ms: 54.2 },
  '1x128': { tokensPerSecond: 192 },
};

export interface WorkloadResult {
  name: string;
  streams: number;
  tokens: number;
  rounds: number;
  /** Median over rounds. */
  tokensPerSecond: number;
  tokensPerSecondRounds: number[];
  ttftP50Ms: number;
  ttftP99Ms: number;
  itlP50Ms: number;
  itlP99Ms: number;
  /** ITL p99 of each round alone (the first round runs on cold buffers: fresh pages, onnxruntime's arena growing). */
  itlP99MsRounds: number[];
  /** Median decode step (session.run included) of the rounds' steps. */
  stepP50Ms: number;
  stepP99Ms: number;
}

/** Prompt lengths 8–26 (seeded, the same every run), ids past the special tokens. */
export function peerPrompts(count: number, vocabSize: number, seed = 12): number[][] {
  let state = seed >>> 0;
  const random = (): number => {
    state = (state + 0x6d2b79f5) | 0;
    let t = Math.imul(state ^ (state >>> 15), 1 | state);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4_294_967_296;
  };
  return Array.from({ length: count }, () => {
    const length = 8 + Math.floor(random() * 19);
    return Array.from({ length }, () => 3 + Math.floor(random() * (vocabSize - 3)));
  });
}

/**
 * Runs a workload's requests: its streams at once, each sending its `requests` prompts one after
 * another (`run` gets a prompt and its index). Returns each stream's results in order.
 */
export async function runStreams<T>(
  workload: PeerWorkload,
  vocabSize: number,
  seed: number,
  run: (prompt: number[], index: number) => Promise<T>,
): Promise<T[][]> {
  const requests = workload.requests ?? 1;
  const prompts = peerPrompts(workload.streams * requests, vocabSize, seed);
  return Promise.all(
    Array.from({ length: workload.streams }, async (_, stream) => {
      const results: T[] = [];
      for (let i = stream * requests; i < (stream + 1) * requests; i++) results.push(await run(prompts[i]!, i));
      return results;
    }),
  );
}

async function runOnce(engine: Engine, workload: PeerWorkload, vocabSize: number, round: number) {
  const steps: number[] = [];
  const off = engine.onStep((stats) => {
    if (stats.phase === 'decode') steps.push(stats.stepMs);
  });
  const ttft: number[] = [];
  const itl: number[] = [];
  let tokens = 0;
  const start = performance.now();
  const generate = async (promptTokenIds: number[], i: number) => {
    const submitted = performance.now();
    let last: number | undefined;
    const stream = engine.generate({
      id: `peer-${workload.name}-${round}-${i}`,
      promptTokenIds,
      sampling: { maxTokens: workload.tokens, temperature: 0, ignoreEos: true },
    });
    for await (const event of stream) {
      if (event.type === 'text-delta') {
        const at = performance.now();
        if (last === undefined) ttft.push(at - submitted);
        else itl.push(at - last);
        last = at;
      } else if (event.type === 'finish') {
        if (event.error !== undefined) throw new Error(event.error.message);
        tokens += event.usage.completionTokens;
      }
    }
  };
  await runStreams(workload, vocabSize, 12 + round, generate);
  const wallMs = performance.now() - start;
  off();
  return { tokensPerSecond: (tokens * 1000) / wallMs, ttft, itl, steps };
}

/** Runs each workload `rounds` times, workloads interleaved round by round (machine noise hits all alike). */
export async function runPeerWorkloads(
  engine: Engine,
  vocabSize: number,
  rounds: number,
  log: (line: string) => void,
  workloads: readonly PeerWorkload[] = PEER_WORKLOADS,
): Promise<WorkloadResult[]> {
  const collected = workloads.map(() => ({
    tps: [] as number[],
    ttft: [] as number[],
    itl: [] as number[],
    itlP99: [] as number[],
    steps: [] as number[],
  }));
  for (let round = 0; round < rounds; round++) {
    for (const [w, workload] of workloads.entries()) {
      const result = await runOnce(engine, workload, vocabSize, round);
      const into = collected[w]!;
      into.tps.push(result.tokensPerSecond);
      into.ttft.push(...result.ttft);
      into.itl.push(...result.itl);
      into.itlP99.push(percentile(result.itl, 99));
      into.steps.push(...result.steps);
      log(
        `round ${round + 1}/${rounds} ${workload.name.padEnd(6)} ${result.tokensPerSecond.toFixed(1)} tok/s, TTFT p99 ${percentile(result.ttft, 99).toFixed(0)} ms, ` +
          `ITL p50 ${percentile(result.itl, 50).toFixed(1)} ms, p99 ${percentile(result.itl, 99).toFixed(1)} ms`,
      );
    }
  }
  return workloads.map((workload, w) => {
    const c = collected[w]!;
    return {
      ...workload,
      rounds,
      tokensPerSecond: median(c.tps),
      tokensPerSecondRounds: c.tps,
      ttftP50Ms: percentile(c.ttft, 50),
      ttftP99Ms: percentile(c.ttft, 99),
      itlP50Ms: percentile(c.itl, 50),
      itlP99Ms: percentile(c.itl, 99),
      itlP99MsRounds: c.itlP99,
      stepP50Ms: percentile(c.steps, 50),
      stepP99Ms: percentile(c.steps, 99),
    };
  });
}

/** The markdown table of {@link runPeerWorkloads}' results beside the peer's figures. */
export function renderPeerTable(results: readonly WorkloadResult[]): string {
  const rows = results.map((r) => {
    const peer = PEER_FIGURES[r.name];
    const ratio = peer === undefined ? '' : `${(r.tokensPerSecond / peer.tokensPerSecond).toFixed(2)}×`;
    const rounds = r.itlP99MsRounds.map((ms) => ms.toFixed(1)).join(' / ');
    return `| ${r.streams} × ${r.tokens} | ${r.tokensPerSecond.toFixed(1)} | ${peer?.tokensPerSecond ?? ''} | ${ratio} | ${r.ttftP50Ms.toFixed(0)} | ${r.ttftP99Ms.toFixed(0)} | ${r.itlP50Ms.toFixed(1)} | ${r.itlP99Ms.toFixed(1)} | ${rounds} | ${peer?.itlP99Ms ?? ''} |`;
  });
  const at128 = results.find((r) => r.name === '32x128');
  const at768 = results.find((r) => r.name === '32x768');
  const ratio = at128 !== undefined && at768 !== undefined ? at768.tokensPerSecond / at128.tokensPerSecond : Number.NaN;
  return [
    '| workload | tokens/s | llama.cpp tokens/s | vs llama.cpp | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | ITL p99 per round (ms; the first on cold buffers) | llama.cpp ITL p99 (ms) |',
    '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
    ...rows,
    '',
    `Throughput at 768 tokens ÷ at 128 tokens (32 streams): **${ratio.toFixed(2)}** (llama.cpp: ${(987 / 1189).toFixed(2)}; target ≥ 0.95).`,
  ].join('\n');
}

export { median };
