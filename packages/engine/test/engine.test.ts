import { ensureBuiltinModel, loadModelDir, type ModelDir } from '@sluice/model';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createEngine, EngineError, type Engine, type StepStats } from '../src/index.js';
import { physicalCores } from '../src/physical-cores.js';
import { collect } from './support/collect.js';

let engine: Engine;
let model: ModelDir;
let prompt: number[];

beforeAll(async () => {
  const modelDir = await ensureBuiltinModel('tiny');
  model = await loadModelDir(modelDir);
  prompt = model.tokenizer.encode('The quick brown fox jumps over the lazy dog');
  engine = await createEngine({ modelDir, maxBatchSize: 8, maxStepTokens: 64, intraOpThreads: 1 });
});

afterAll(async () => {
  await engine.close();
});

describe('createEngine on the tiny model', () => {
  it('describes the model it serves', () => {
    expect(engine.info).toEqual({
      modelId: 'tiny',
      maxContextLength: 2048,
      maxBatchSize: 8,
      maxCachedTokens: 8 * 2048,
      executionProvider: 'cpu',
      kvReservedBytes: 0,
      intraOpThreads: 1,
      kvCache: 'engine-owned',
      groupQueryAttention: 'none',
      splitAttentionLayers: 0,
    });
  });

  it('offers no more context than its whole KV cache holds', async () => {
    const small = await createEngine({
      modelDir: await ensureBuiltinModel('tiny'),
      maxBatchSize: 2,
      maxCachedTokens: 300,
      intraOpThreads: 1,
    });
    try {
      expect(small.info.maxContextLength).toBe(300);
      expect(() => small.generate({ id: 'too-long', promptTokenIds: prompt, sampling: { maxTokens: 300 } })).toThrow(
        /context length of 300 tokens/,
      );
      const served = await collect(
        small.generate({
          id: 'fits',
          promptTokenIds: prompt,
          sampling: { maxTokens: 300 - prompt.length, ignoreEos: true, temperature: 0 },
        }),
      );
      expect(served.tokens[0]).toHaveLength(300 - prompt.length);
    } finally {
      await small.close();
    }
  });

  it('runs one intra-op thread per physical core unless told otherwise', async () => {
    const defaults = await createEngine({ modelDir: await ensureBuiltinModel('tiny'), maxBatchSize: 1 });
    try {
      expect(defaults.info.intraOpThreads).toBe(physicalCores());
    } finally {
      await defaults.close();
    }
  });

  it('streams token ids and their text, then ends each choice and finishes with usage and timings', async () => {
    const result = await collect(
      engine.generate({ id: 'basic', promptTokenIds: prompt, sampling: { maxTokens: 12, temperature: 0, ignoreEos: true } }),
    );
    expect(result.tokens[0]).toHaveLength(12);
    expect(result.texts[0]).toBe(model.tokenizer.decode(result.tokens[0]!));
    expect(result.endReasons).toEqual(['length']);
    expect(result.finish.usage).toEqual({ promptTokens: prompt.length, completionTokens: 12 });
    const { queueMs, prefillMs, firstTokenMs } = result.finish.timings;
    expect(queueMs).toBeGreaterThanOrEqual(0);
    expect(prefillMs).toBeGreaterThan(0);
    expect(firstTokenMs).toBeGreaterThanOrEqual(queueMs + prefillMs - 1);
    expect(result.events.at(-2)).toEqual({ type: 'text-end', index: 0, finishReason: 'length' });
  });

  it('says when a request leaves its waiting queue: one scheduled event, before its first token, only once a row is free', async () => {
    const one = await createEngine({ modelDir: await ensureBuiltinModel('tiny'), maxBatchSize: 1, maxStepTokens: 64, intraOpThreads: 1 });
    try {
      const order: string[] = [];
      const run = (id: string, maxTokens: number) =>
        collect(one.generate({ id, promptTokenIds: prompt, sampling: { maxTokens, temperature: 0, ignoreEos: true } }), () =>
          order.push(id),
        );
      const first = run('a', 30);
      const second = run('b', 2);
      const [a, b] = await Promise.all([first, second]);
      for (const result of [a, b]) {
        expect(result.events.filter((e) => e.type === 'scheduled')).toHaveLength(1);
        expect(result.events[0]).toEqual({ type: 'scheduled' });
      }
      // One row: b waited in the engine until a finished (every token of a came before b's first).
      expect(order.lastIndexOf('a')).toBeLessThan(order.indexOf('b'));
      expect(b.finish.timings.queueMs).toBeGreaterThan(a.finish.timings.queueMs);
    } finally {
      await one.close();
    }
  });

  it('rejects at once a prompt plus max_tokens beyond the context length, with the numbers', () => {
    const call = () => engine.generate({ id: 'long', promptTokenIds: prompt, sampling: { maxTokens: 2048 } });
    expect(call).toThrow(EngineError);
    expect(call).toThrow(
      `prompt (${prompt.length} tokens) + maxTokens (2048) = ${prompt.length + 2048} tokens exceeds the model's context length of 2048`,
    );
    try {
      call();
    } catch (error) {
      expect((error as EngineError).code).toBe('context_length_exceeded');
    }
  });

  it('rejects invalid parameters as invalid_request naming the field', () => {
    for (const [sampling, field] of [
      [{ n: 0 }, 'n'],
      [{ topP: 1.5 }, 'topP'],
      [{ topLogprobs: 21 }, 'topLogprobs'],
    ] as const) {
      try {
        engine.generate({ id: 'bad', promptTokenIds: prompt, sampling });
        expect.unreachable();
      } catch (error) {
        expect(error).toBeInstanceOf(EngineError);
        expect((error as EngineError).code).toBe('invalid_request');
        expect((error as EngineError).message).toContain(field);
      }
    }
  });

  it('stops at a stop string without emitting it, and at a stop token id whose text it omits but counts', async () => {
    const free = await collect(
      engine.generate({ id: 'free', promptTokenIds: prompt, sampling: { maxTokens: 24, temperature: 0, ignoreEos: true } }),
    );
    const text = free.texts[0]!;
    const stop = text.slice(6, 9);
    const stopped = await collect(
      engine.generate({ id: 'stop', promptTokenIds: prompt, sampling: { maxTokens: 24, temperature: 0, ignoreEos: true, stop: [stop] } }),
    );
    expect(stopped.endReasons).toEqual(['stop']);
    expect(stopped.texts[0]).toBe(text.slice(0, text.indexOf(stop)));
    const stopId = free.tokens[0]![5]!;
    const byId = await collect(
      engine.generate({
        id: 'stop-id',
        promptTokenIds: prompt,
        sampling: { maxTokens: 24, temperature: 0, ignoreEos: true, stopTokenIds: [stopId] },
      }),
    );
    expect(byId.endReasons).toEqual(['stop']);
    const stopAt = free.tokens[0]!.indexOf(stopId);
    expect(byId.tokens[0]).toEqual(free.tokens[0]!.slice(0, stopAt + 1));
    // The stop token is an ordinary (non-special) token: its id is reported and counted, its text is not.
    expect(model.tokenizer.decode([stopId])).not.toBe('');
    expect(byId.texts[0]).toBe(model.tokenizer.decode(free.tokens[0]!.slice(0, stopAt)));
    expect(byId.finish.usage.completionTokens).toBe(stopAt + 1);
  });

  it('stops at EOS unless ignoreEos, reporting the EOS id without text', async () => {
    const eos = model.generation.eosTokenIds[0]!;
    let found = false;
    for (let seed = 0; seed < 12 && !found; seed++) {
      const promptTokenIds = Array.from({ length: 6 }, (_, i) => 3 + ((seed * 97 + i * 31) % 1000));
      const free = await collect(
        engine.generate({ id: `eos-free-${seed}`, promptTokenIds, sampling: { maxTokens: 200, temperature: 0, ignoreEos: true } }),
      );
      const at = free.tokens[0]!.indexOf(eos);
      if (at < 0 || at === 199) continue;
      found = true;
      const stopped = await collect(engine.generate({ id: `eos-${seed}`, promptTokenIds, sampling: { maxTokens: 200, temperature: 0 } }));
      expect(stopped.tokens[0]).toEqual(free.tokens[0]!.slice(0, at + 1));
      expect(stopped.endReasons).toEqual(['stop']);
      expect(stopped.texts[0]).toBe(model.tokenizer.decode(free.tokens[0]!.slice(0, at)));
    }
    expect(found).toBe(true);
  });

  it('returns logprobs with top alternatives that include the greedy choice', async () => {
    const result = await collect(
      engine.generate({ id: 'lp', promptTokenIds: prompt, sampling: { maxTokens: 4, temperature: 0, topLogprobs: 3 } }),
    );
    for (const [i, entry] of result.logprobs[0]!.entries()) {
      expect(entry.tokenId).toBe(result.tokens[0]![i]);
      expect(entry.logprob).toBeLessThanOrEqual(0);
      expect(entry.topLogprobs).toHaveLength(3);
      expect(entry.topLogprobs![0]!.tokenId).toBe(entry.tokenId);
      expect(entry.token).toBe(model.tokenizer.decode([entry.tokenId], { skipSpecialTokens: false }));
    }
  });

  it('runs n > 1 as siblings sharing one prefill, each with its own generator', async () => {
    const steps: StepStats[] = [];
    const off = engine.onStep((stats) => steps.push(stats));
    const result = await collect(
      engine.generate({ id: 'n3', promptTokenIds: prompt, sampling: { maxTokens: 16, temperature: 1.5, seed: 5, n: 3, ignoreEos: true } }),
    );
    off();
    expect(result.tokens).toHaveLength(3);
    expect(result.finish.usage).toEqual({ promptTokens: prompt.length, completionTokens: 48 });
    expect(new Set(result.tokens.map((tokens) => tokens.join())).size).toBeGreaterThan(1);
    // The prompt went through the model once.
    expect(steps.reduce((sum, stats) => sum + stats.promptTokens, 0)).toBe(prompt.length);
    const again = await collect(
      engine.generate({
        id: 'n3-again',
        promptTokenIds: prompt,
        sampling: { maxTokens: 16, temperature: 1.5, seed: 5, n: 3, ignoreEos: true },
      }),
    );
    expect(again.tokens).toEqual(result.tokens);
  });

  it('runs every sibling when the first one ends on its first token, and leaves no row behind', async () => {
    const steps: StepStats[] = [];
    const off = engine.onStep((stats) => steps.push(stats));
    // max_tokens 1: every choice ends on its first token, each with its own end event. A seed whose
    // choice 0 draws a first token its siblings do not (the draws are deterministic per seed).
    let sampling = { temperature: 4, seed: 0, n: 3, ignoreEos: true };
    let firstOfChoice0 = -1;
    for (let seed = 1; seed <= 50 && firstOfChoice0 < 0; seed++) {
      sampling = { ...sampling, seed };
      const one = await collect(engine.generate({ id: `n3-one-${seed}`, promptTokenIds: prompt, sampling: { ...sampling, maxTokens: 1 } }));
      expect(one.tokens.map((tokens) => tokens.length)).toEqual([1, 1, 1]);
      expect(one.endReasons).toEqual(['length', 'length', 'length']);
      expect(one.finish.usage.completionTokens).toBe(3);
      expect(one.events.filter((event) => event.type === 'finish')).toHaveLength(1);
      if (!one.tokens.slice(1).some((tokens) => tokens[0] === one.tokens[0]![0])) firstOfChoice0 = one.tokens[0]![0]!;
    }
    expect(firstOfChoice0).toBeGreaterThanOrEqual(0);
    // Choice 0's first token as a stop token: choice 0 stops at once, its siblings still run to the end.
    const stopped = await collect(
      engine.generate({
        id: 'n3-stop',
        promptTokenIds: prompt,
        sampling: { ...sampling, maxTokens: 16, stopTokenIds: [firstOfChoice0] },
      }),
    );
    off();
    expect(stopped.tokens[0]).toEqual([firstOfChoice0]);
    expect(stopped.endReasons[0]).toBe('stop');
    for (const index of [1, 2]) {
      const tokens = stopped.tokens[index]!;
      const reason = stopped.endReasons[index];
      // Each sibling ends on its own: at its 16th token, or at the stop token if it draws it.
      expect(reason === 'length' ? tokens.length === 16 : reason === 'stop' && tokens.at(-1) === firstOfChoice0).toBe(true);
    }
    expect(stopped.finish.usage.completionTokens).toBe(stopped.tokens.reduce((sum, tokens) => sum + tokens.length, 0));
    // No sequence outlives its request (they used to decode on as rows of a finished group).
    for (let waited = 0; steps.at(-1)?.running !== 0 && waited < 10_000; waited += 10) {
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
    expect(steps.at(-1)).toMatchObject({ cachedTokens: 0, running: 0 });
  });

  it('ends an aborted request with finish reason abort and frees its cache', async () => {
    const steps: StepStats[] = [];
    const off = engine.onStep((stats) => steps.push(stats));
    const controller = new AbortController();
    const result = await collect(
      engine.generate(
        { id: 'abort', promptTokenIds: prompt, sampling: { maxTokens: 1500, temperature: 0, ignoreEos: true } },
        controller.signal,
      ),
      (count) => {
        if (count === 5) controller.abort();
      },
    );
    off();
    expect(result.endReasons).toEqual(['abort']);
    // How many steps run between abort() on this thread and the boundary the engine thread sees it at
    // depends on the machine (steps here are sub-millisecond); engine-core.test.ts pins the boundary.
    expect(result.tokens[0]!.length).toBeGreaterThanOrEqual(5);
    expect(result.tokens[0]!.length).toBeLessThan(1500);
    expect(result.finish.usage.completionTokens).toBe(result.tokens[0]!.length);
    expect(steps.some((stats) => stats.cachedTokens > 0)).toBe(true);
    // Each step reports the engine thread's event-loop delay (its own histogram, not the host's).
    expect(steps.every((stats) => typeof stats.eventLoopLagMs === 'number' && stats.eventLoopLagMs >= 0)).toBe(true);
    expect(steps.at(-1)).toMatchObject({ cachedTokens: 0, running: 0, waiting: 0 });
  });

  it('cancels the request when the reader stops early', async () => {
    const steps: StepStats[] = [];
    const off = engine.onStep((stats) => steps.push(stats));
    for await (const event of engine.generate({ id: 'break', promptTokenIds: prompt, sampling: { maxTokens: 1500, ignoreEos: true } })) {
      if (event.type === 'text-delta') break;
    }
    // The engine thread reports the step the sequence left in (polled: a loaded machine delivers it late).
    for (let waited = 0; steps.at(-1)?.running !== 0 && waited < 10_000; waited += 10) {
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
    off();
    expect(steps.at(-1)).toMatchObject({ cachedTokens: 0, running: 0 });
    expect(steps.reduce((sum, stats) => sum + stats.generationTokens, 0)).toBeLessThan(1500);
  });

  it('ends a request whose signal was already aborted without running it', async () => {
    const result = await collect(engine.generate({ id: 'pre', promptTokenIds: prompt, sampling: { n: 2 } }, AbortSignal.abort()));
    expect(result.endReasons).toEqual(['abort', 'abort']);
    expect(result.finish.usage.completionTokens).toBe(0);
  });
});

describe('execution providers', () => {
  it('either runs on CUDA or fails with provider_unavailable naming it, never silently on another provider', async () => {
    const modelDir = await ensureBuiltinModel('tiny');
    const outcome = await createEngine({ modelDir, executionProvider: 'cuda' }).then(
      async (cuda) => {
        try {
          const result = await collect(
            cuda.generate({ id: 'cuda', promptTokenIds: prompt, sampling: { maxTokens: 4, temperature: 0, ignoreEos: true } }),
          );
          expect(result.tokens[0]).toHaveLength(4);
          return cuda.info.executionProvider;
        } finally {
          await cuda.close();
        }
      },
      (error: unknown) => {
        expect(error).toBeInstanceOf(EngineError);
        expect((error as EngineError).message).toMatch(/Execution provider 'cuda' is unavailable/);
        return (error as EngineError).code;
      },
    );
    expect(['cuda', 'provider_unavailable']).toContain(outcome);
  });

  it('either runs on WebGPU or fails with provider_unavailable, never silently on another provider', async () => {
    const modelDir = await ensureBuiltinModel('tiny');
    const outcome = await createEngine({ modelDir, executionProvider: 'webgpu' }).then(
      async (webgpu) => {
        const info = webgpu.info;
        await webgpu.close();
        return info.executionProvider;
      },
      (error: unknown) => (error instanceof EngineError ? error.code : 'other error'),
    );
    expect(['webgpu', 'provider_unavailable']).toContain(outcome);
  });

  it('fails with engine_closed after close', async () => {
    const modelDir = await ensureBuiltinModel('tiny');
    const closing = await createEngine({ modelDir });
    await closing.close();
    expect(() => closing.generate({ id: 'late', promptTokenIds: [5], sampling: {} })).toThrow(/closed/);
  });
});
