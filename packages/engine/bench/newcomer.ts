/**
 * A newcomer joining a full batch (issue 12's TTFT target: one step plus its own prefill). `rows`
 * background streams decode long answers (the batch one row short of full), and newcomers arrive one
 * at a time at seeded random moments within a step, each with a prompt of 8–26 tokens and two tokens
 * to generate. Per newcomer: TTFT and time to its second token (submission → token event on the host
 * thread). Beside them: the full batch's decode steps while the newcomers came, and each newcomer's
 * prompt alone on the idle engine (its TTFT there is its own prefill plus the step around it).
 */
import { setMaxListeners } from 'node:events';
import type { Engine } from '../src/index.js';
import { SeededRandom } from '../src/seeded-random.js';
import { peerPrompts } from './peer-workloads.js';
import { percentile } from './raw-session.js';

export interface NewcomerOptions {
  /** Background streams decoding while the newcomers come (maxBatchSize − 1: the newcomer fills the batch). */
  rows: number;
  /** Newcomers, one after another. */
  newcomers: number;
  seed: number;
}

export interface NewcomerResult {
  rows: number;
  newcomers: number;
  ttftP50Ms: number;
  ttftP99Ms: number;
  secondTokenP50Ms: number;
  secondTokenP99Ms: number;
  /** Decode steps of the full batch (every row decoding, no prompt) while the newcomers came. */
  stepP50Ms: number;
  stepP99Ms: number;
  /** The newcomers' prompts alone on the idle engine: TTFT. */
  aloneTtftP50Ms: number;
  aloneTtftP99Ms: number;
}

/** Submission → first and second token events of one request. */
async function firstTwo(engine: Engine, id: string, promptTokenIds: number[]): Promise<[number, number]> {
  const submitted = performance.now();
  const at: number[] = [];
  for await (const event of engine.generate({ id, promptTokenIds, sampling: { maxTokens: 2, temperature: 0, ignoreEos: true } })) {
    if (event.type === 'text-delta') for (let i = 0; i < event.tokenIds.length; i++) at.push(performance.now() - submitted);
    else if (event.type === 'finish' && event.error !== undefined) throw new Error(event.error.message);
  }
  return [at[0]!, at[1]!];
}

export async function runNewcomers(
  engine: Engine,
  vocabSize: number,
  options: NewcomerOptions,
  log: (line: string) => void,
): Promise<NewcomerResult> {
  const prompts = peerPrompts(options.newcomers, vocabSize, options.seed);
  const random = new SeededRandom(options.seed);

  const alone: number[] = [];
  for (const [i, prompt] of prompts.entries()) alone.push((await firstTwo(engine, `alone-${i}`, prompt))[0]);

  const stop = new AbortController();
  setMaxListeners(options.rows + 1, stop.signal);
  const steps: number[] = [];
  let measuring = false;
  const off = engine.onStep((stats) => {
    if (measuring && stats.phase === 'decode' && stats.batchSize >= options.rows) steps.push(stats.stepMs);
  });
  let started = 0;
  let resolveStarted: () => void = () => {};
  const allStarted = new Promise<void>((resolve) => (resolveStarted = resolve));
  const background = peerPrompts(options.rows, vocabSize, options.seed + 1).map(async (promptTokenIds, i) => {
    let first = true;
    const stream = engine.generate(
      { id: `background-${i}`, promptTokenIds, sampling: { maxTokens: 1_000, temperature: 0, ignoreEos: true } },
      stop.signal,
    );
    for await (const event of stream) {
      if (event.type === 'text-delta' && first) {
        first = false;
        if (++started === options.rows) resolveStarted();
      } else if (event.type === 'finish' && event.error !== undefined) throw new Error(event.error.message);
    }
    // Ended before the newcomers did: the batch was no longer full.
    if (measuring) throw new Error(`background-${i} ended while newcomers were still coming`);
  });
  const ttft: number[] = [];
  const second: number[] = [];
  let settled: Array<PromiseSettledResult<void>> = [];
  try {
    await Promise.race([
      allStarted,
      Promise.all(background).then(() => {
        throw new Error('the background streams ended before all of them decoded');
      }),
    ]);
    measuring = true;
    for (const [i, prompt] of prompts.entries()) {
      // A random moment within the step in progress (the median decode step so far, 30 ms before any).
      const stepMs = steps.length === 0 ? 30 : percentile(steps, 50);
      await new Promise((resolve) => setTimeout(resolve, random.next() * stepMs));
      const [first, next] = await firstTwo(engine, `newcomer-${i}`, prompt);
      ttft.push(first);
      second.push(next);
    }
    measuring = false;
  } finally {
    off();
    stop.abort();
    settled = await Promise.allSettled(background);
  }
  const failed = settled.find((outcome) => outcome.status === 'rejected');
  if (failed !== undefined) throw failed.reason;
  const result: NewcomerResult = {
    rows: options.rows,
    newcomers: options.newcomers,
    ttftP50Ms: percentile(ttft, 50),
    ttftP99Ms: percentile(ttft, 99),
    secondTokenP50Ms: percentile(second, 50),
    secondTokenP99Ms: percentile(second, 99),
    stepP50Ms: percentile(steps, 50),
    stepP99Ms: percentile(steps, 99),
    aloneTtftP50Ms: percentile(alone, 50),
    aloneTtftP99Ms: percentile(alone, 99),
  };
  log(
    `newcomers joining ${options.rows} rows: TTFT p50 ${result.ttftP50Ms.toFixed(1)} / p99 ${result.ttftP99Ms.toFixed(1)} ms, ` +
      `second token p50 ${result.secondTokenP50Ms.toFixed(1)} / p99 ${result.secondTokenP99Ms.toFixed(1)} ms; ` +
      `full-batch decode step p50 ${result.stepP50Ms.toFixed(1)} / p99 ${result.stepP99Ms.toFixed(1)} ms; ` +
      `alone TTFT p50 ${result.aloneTtftP50Ms.toFixed(1)} / p99 ${result.aloneTtftP99Ms.toFixed(1)} ms`,
  );
  return result;
}

/** The target: a newcomer's TTFT p99 within one full-batch step (p99) plus its own prefill (alone, p99). */
export function newcomerWithinOneStep(result: NewcomerResult): boolean {
  return result.ttftP99Ms <= result.stepP99Ms + result.aloneTtftP99Ms;
}
