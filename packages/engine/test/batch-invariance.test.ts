import type { AttentionForm } from '@sluice/model';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createEngine, type Engine, type GenerateRequest, type GqaAttention, type SamplingParams, type StepStats } from '../src/index.js';
import { collect, type Collected } from './support/collect.js';
import { ATTENTION_FORMS, tinyModelDir } from './support/model-forms.js';

/**
 * The core property: a request's tokens do not depend on what else shares its batch. Dozens of
 * requests arrive staggered into an engine with a small batch, a small step budget (long prompts
 * are prefilled in chunks while others decode) and a small KV cap (requests wait); each one's
 * greedy and seeded-sampled tokens must equal what it gets running alone on an engine that
 * prefills every prompt in one call. Every attention form (plain operators, GroupQueryAttention with
 * rotary before or inside it, the latter also decomposed into the plain form's ops).
 */

interface Case {
  request: GenerateRequest;
  /** Submitted once the batched engine has run this many steps (see {@link StepClock}). */
  arrivalStep: number;
  /** Abort after this many tokens. */
  cancelAfter?: number;
}

function random(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4_294_967_296;
  };
}

function makeCases(count: number): Case[] {
  const rand = random(2024);
  const pick = (min: number, max: number) => min + Math.floor(rand() * (max - min + 1));
  return Array.from({ length: count }, (_, i) => {
    const promptLength = i % 6 === 0 ? pick(90, 200) : pick(2, 40);
    const promptTokenIds = Array.from({ length: promptLength }, () => pick(3, 1023));
    const kind = i % 4;
    const sampling: SamplingParams = { maxTokens: pick(4, 48), ignoreEos: i % 5 !== 0 };
    if (kind === 0 || kind === 1) {
      sampling.temperature = 0;
    } else {
      Object.assign(sampling, {
        temperature: 0.6 + rand(),
        topP: kind === 2 ? 0.9 : 1,
        topK: kind === 3 ? 40 : 0,
        minP: kind === 3 ? 0.02 : 0,
        seed: pick(0, 1e9),
        presencePenalty: kind === 2 ? 0.5 : 0,
        frequencyPenalty: kind === 3 ? 0.3 : 0,
        repetitionPenalty: kind === 2 ? 1.2 : 1,
        n: i % 7 === 3 ? 2 : 1,
      });
    }
    if (i % 9 === 4) sampling.logprobs = true;
    // The first arrives at once (steps run only while there is work); the rest over about two lifetimes.
    const arrivalStep = i === 0 ? 0 : Math.floor(rand() * 60);
    const entry: Case = { request: { id: `case-${i}`, promptTokenIds, sampling }, arrivalStep };
    if (i % 8 === 5) entry.cancelAfter = pick(1, 6);
    return entry;
  });
}

/**
 * Arrivals counted in engine steps, not milliseconds, so that the batch fills the same way on a fast
 * machine as on a slow one. A case waiting for a step the engine will not run (nothing left in flight)
 * is let in at once.
 */
class StepClock {
  #steps = 0;
  #inFlight = 0;
  #waiting: Array<{ step: number; go: () => void }> = [];

  /** Call from the engine's onStep. */
  tick(): void {
    this.#steps++;
    this.#release();
  }

  /** Runs `body` once `step` steps have run; counts it in flight meanwhile. */
  async at<T>(step: number, body: () => Promise<T>): Promise<T> {
    if (step > this.#steps) await new Promise<void>((go) => this.#waiting.push({ step, go }));
    this.#inFlight++;
    try {
      return await body();
    } finally {
      if (--this.#inFlight === 0 && this.#waiting.length > 0) {
        this.#steps = Math.min(...this.#waiting.map((entry) => entry.step));
        this.#release();
      }
    }
  }

  #release(): void {
    const ready = this.#waiting.filter((entry) => entry.step <= this.#steps);
    this.#waiting = this.#waiting.filter((entry) => entry.step > this.#steps);
    for (const entry of ready) entry.go();
  }
}

/** Adds stop strings / stop token ids taken from each request's own free-running output, so they fire. */
async function addStops(alone: Engine, cases: Case[]): Promise<void> {
  for (const [i, entry] of cases.entries()) {
    if (i % 5 !== 2 && i % 5 !== 3) continue;
    const free = await collect(alone.generate(entry.request));
    const tokens = free.tokens[0]!;
    const text = free.texts[0]!;
    if (i % 5 === 2 && text.length > 8) entry.request.sampling.stop = [text.slice(text.length / 2, text.length / 2 + 2), 'zzzz'];
    if (i % 5 === 3 && tokens.length > 3) entry.request.sampling.stopTokenIds = [tokens[Math.floor(tokens.length / 2)]!];
  }
}

const INVARIANCE_FORMS: ReadonlyArray<{ form: AttentionForm; gqaAttention: GqaAttention; label: string }> = [
  ...ATTENTION_FORMS.map((form) => ({ form, gqaAttention: 'op' as const, label: form })),
  { form: 'gqa-fused', gqaAttention: 'decomposed', label: 'gqa-fused, decomposed' },
];

describe.each(INVARIANCE_FORMS)('batch invariance, $label attention', ({ form, gqaAttention }) => {
  let batched: Engine;
  let alone: Engine;
  let remove: () => Promise<void>;

  beforeAll(async () => {
    const made = await tinyModelDir(form);
    remove = made.remove;
    [batched, alone] = await Promise.all([
      createEngine({ modelDir: made.dir, maxBatchSize: 8, maxStepTokens: 40, maxCachedTokens: 1200, intraOpThreads: 1, gqaAttention }),
      createEngine({ modelDir: made.dir, maxBatchSize: 8, maxStepTokens: 2048, intraOpThreads: 1, gqaAttention }),
    ]);
  });

  afterAll(async () => {
    await Promise.all([batched?.close(), alone?.close()]);
    await remove?.();
  });

  it('gives every request, batched with staggered others, the tokens it gets alone (greedy, seeded sampling, stops, cancels, n = 2)', async () => {
    const cases = makeCases(40);
    await addStops(alone, cases);

    const reference: Collected[] = [];
    for (const { request } of cases) reference.push(await collect(alone.generate(request)));

    const steps: StepStats[] = [];
    const clock = new StepClock();
    const off = batched.onStep((stats) => {
      steps.push(stats);
      clock.tick();
    });
    const results = await Promise.all(
      cases.map(({ request, arrivalStep, cancelAfter }) =>
        clock.at(arrivalStep, () => {
          const controller = new AbortController();
          return collect(batched.generate(request, controller.signal), (count) => {
            if (count === cancelAfter) controller.abort();
          });
        }),
      ),
    );
    off();

    for (const [i, { request, cancelAfter }] of cases.entries()) {
      const got = results[i]!;
      const want = reference[i]!;
      if (cancelAfter !== undefined && got.endReasons.includes('abort')) {
        got.tokens.forEach((tokens, index) => expect(tokens, request.id).toEqual(want.tokens[index]!.slice(0, tokens.length)));
        continue;
      }
      expect(got.tokens, request.id).toEqual(want.tokens);
      expect(got.texts, request.id).toEqual(want.texts);
      expect(got.endReasons, request.id).toEqual(want.endReasons);
      if (request.sampling.logprobs === true) {
        got.logprobs[0]!.forEach((entry, t) => expect(entry.logprob).toBeCloseTo(want.logprobs[0]![t]!.logprob, 3));
      }
    }

    // The run exercised what it claims to: concurrency, chunked prefill next to decode, waiting, stops, cancels.
    expect(Math.max(...steps.map((stats) => stats.batchSize))).toBeGreaterThanOrEqual(6);
    expect(steps.some((stats) => stats.phase === 'mixed')).toBe(true);
    expect(steps.some((stats) => stats.waiting > 0)).toBe(true);
    expect(results.filter((result) => result.endReasons.includes('abort')).length).toBeGreaterThanOrEqual(3);
    expect(results.filter((result) => result.endReasons.includes('stop')).length).toBeGreaterThanOrEqual(6);
    expect(steps.at(-1)?.cachedTokens).toBe(0);
  });
});

/**
 * A request's logprobs are bit-identical batched or alone on the same engine, in every form: every
 * piece of its prompt is computed by the same calls whatever else runs (the pieces used to follow the
 * budget the decode rows left, and onnxruntime's kernels give calls of other lengths other last bits:
 * up to 7.6e-6 seen under churn), and a decode row's scores are summed in the same order whatever
 * the lane's capacity (whole KV blocks: `kv-lane.ts`). Alone, these prompts decode in a lane of 64 or
 * 128 slots; beside the five long generations, in one of 448. Before the capacity was kept to whole
 * blocks it followed each row’s reservation (40 to 119 slots here) and the plain form’s
 * logprobs differed by up to 1e-5.
 */
describe.each(INVARIANCE_FORMS)('logprobs to the last bit, $label attention', ({ form, gqaAttention }) => {
  let engine: Engine;
  let remove: () => Promise<void>;

  beforeAll(async () => {
    const made = await tinyModelDir(form);
    remove = made.remove;
    engine = await createEngine({ modelDir: made.dir, maxBatchSize: 8, maxStepTokens: 40, intraOpThreads: 1, gqaAttention });
  });

  afterAll(async () => {
    await engine?.close();
    await remove?.();
  });

  it('gives a long prompt the same logprobs alone and beside decoding rows', async () => {
    const rand = random(7);
    const lengths = [34, 41, 65, 73, 97, 113];
    const requests: GenerateRequest[] = lengths.map((length, i) => ({
      id: `prompt-${length}`,
      promptTokenIds: Array.from({ length }, () => 3 + Math.floor(rand() * 1000)),
      sampling: { maxTokens: 6, temperature: 0, ignoreEos: true, logprobs: true, topLogprobs: 2, seed: i },
    }));
    const alone: Collected[] = [];
    for (const request of requests) alone.push(await collect(engine.generate(request)));

    // Each again, while five long generations decode beside it.
    for (const [i, request] of requests.entries()) {
      const controller = new AbortController();
      const neighbours = Array.from({ length: 5 }, (_, k) =>
        collect(
          engine.generate(
            { id: `neighbour-${i}-${k}`, promptTokenIds: [5 + k, 9, 11], sampling: { maxTokens: 400, temperature: 0, ignoreEos: true } },
            controller.signal,
          ),
        ),
      );
      // Counted in steps, not milliseconds: the prompt goes in once the five decode.
      await new Promise<void>((resolve) => {
        const off = engine.onStep((stats) => {
          if (stats.batchSize < 5) return;
          off();
          resolve();
        });
      });
      const phases: string[] = [];
      const off = engine.onStep((stats) => phases.push(stats.phase));
      const busy = await collect(engine.generate({ ...request, id: `${request.id}-busy` }));
      off();
      controller.abort();
      expect(phases, 'prefilled beside decoding rows').toContain('mixed');
      await Promise.all(neighbours);
      expect(busy.tokens, request.id).toEqual(alone[i]!.tokens);
      expect(busy.logprobs, request.id).toEqual(alone[i]!.logprobs);
    }
  });
});
