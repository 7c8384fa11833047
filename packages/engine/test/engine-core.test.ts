import { ensureBuiltinModel, loadModelDir, type ModelDir } from '@sluice/model';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { EngineCore } from '../src/engine-core.js';
import { OnnxSession } from '../src/onnx-session.js';
import { resolveRequest } from '../src/resolve-request.js';
import type { EarlyFirstTokens, EngineEvent } from '../src/types.js';

/**
 * The step loop driven by hand, without the thread: what "at the next step boundary" means is
 * exact here, where the threaded engine's tests can only bound it in time.
 */
let model: ModelDir;
let session: OnnxSession;

beforeAll(async () => {
  model = await loadModelDir(await ensureBuiltinModel('tiny'));
  session = await OnnxSession.create({ modelPath: model.onnxPath, executionProvider: 'cpu', intraOpThreads: 1, interOpThreads: 0 });
});

afterAll(async () => {
  await session?.dispose();
});

function newCore(options: { earlyFirstTokens?: EarlyFirstTokens } = {}): EngineCore {
  return new EngineCore(session, model, {
    earlyFirstTokens: true,
    ...options,
    maxBatchSize: 4,
    maxStepTokens: 64,
    maxCachedTokens: 4 * 2048,
    laneCost: 64,
    exactLengthBatches: false,
    continuationMode: 'replay',
    kvGrowth: 'spread',
    maxPrefillBatch: 1,
  });
}

function request(id: string) {
  return resolveRequest(
    { id, promptTokenIds: model.tokenizer.encode(`The story of ${id}`), sampling: { maxTokens: 100, temperature: 0, ignoreEos: true } },
    { vocabSize: model.tokenizer.vocabSize, maxContextLength: 2048, maxBatchSize: 4, maxCachedTokens: 4 * 2048 },
  );
}

const tokensOf = (events: Array<[number, EngineEvent]>, key: number): number =>
  events.reduce((sum, [k, event]) => sum + (k === key && event.type === 'text-delta' ? event.tokenIds.length : 0), 0);

describe('EngineCore', () => {
  it('ends an aborted sequence at the very next step, before the model runs for it again', async () => {
    const core = newCore();
    core.add(1, request('one'), performance.timeOrigin + performance.now());
    core.add(2, request('two'), performance.timeOrigin + performance.now());
    for (let i = 0; i < 4; i++) await core.step();
    const before = core.cachedTokens;

    core.abort(1);
    const { events, stats } = await core.step();

    expect(tokensOf(events, 1)).toBe(0);
    expect(events.filter(([key]) => key === 1).map(([, event]) => event.type)).toEqual(['text-end', 'finish']);
    expect(events.find(([key, event]) => key === 1 && event.type === 'text-end')?.[1]).toMatchObject({ finishReason: 'abort' });
    // The other sequence decoded its token in the same step, and the aborted one's cache is gone.
    expect(tokensOf(events, 2)).toBe(1);
    expect(stats?.running).toBe(1);
    expect(core.cachedTokens).toBeLessThan(before);

    core.abort(2);
    await core.step();
    expect(core.idle).toBe(true);
    expect(core.cachedTokens).toBe(0);
  });

  /** Request 1 decodes while 2 and 3 arrive, are prefilled (one call each) and join the decode in the same step, with an early listener. */
  async function stepWithNewcomers(core: EngineCore) {
    core.add(1, request('one'), performance.timeOrigin + performance.now());
    await core.step();
    core.add(2, request('two'), performance.timeOrigin + performance.now());
    core.add(3, request('three'), performance.timeOrigin + performance.now());
    const handed: Array<Array<[number, EngineEvent]>> = [];
    const { events, stats } = await core.step((early) => handed.push(early));
    expect(stats?.phase).toBe('mixed');
    expect(stats?.prefillCalls).toBe(2);
    // Three rows: the newcomers count once though they were prefilled and decoded in this step.
    expect(stats?.batchSize).toBe(3);
    // Both prompts, and a decode token for each of the three.
    expect(stats?.stepTokens).toBe(request('two').promptTokenIds.length + request('three').promptTokenIds.length + 3);
    return { handed, events };
  }

  it("with an early listener, hands over each prompt's first token as its prefill ends, and the newcomers decode in the same step", async () => {
    const core = newCore();
    const { handed, events } = await stepWithNewcomers(core);
    // Prompts before the decode: first the newcomers' scheduled events, before the first prefill.
    expect(handed.map((batch) => batch.map(([key, event]) => `${key}:${event.type}`))).toEqual([
      ['2:scheduled', '3:scheduled'],
      ['2:text-delta'],
      ['3:text-delta'],
    ]);
    // The step's own output: the decode, in which 2 and 3 joined 1 (their second tokens).
    expect([1, 2, 3].map((key) => tokensOf(events, key))).toEqual([1, 1, 1]);
    // Without a listener, the same step's events all come with its output.
    const whole = await core.step();
    expect([1, 2, 3].map((key) => tokensOf(whole.events, key))).toEqual([1, 1, 1]);
  });

  it("with earlyFirstTokens 'after-prefills', hands over the step's first tokens together once its last prefill ends, before the decode", async () => {
    const { handed, events } = await stepWithNewcomers(newCore({ earlyFirstTokens: 'after-prefills' }));
    expect(handed.map((batch) => batch.map(([key, event]) => `${key}:${event.type}`))).toEqual([
      ['2:scheduled', '3:scheduled'],
      ['2:text-delta', '3:text-delta'],
    ]);
    // Their second tokens come with the step's output, from its decode.
    expect([1, 2, 3].map((key) => tokensOf(events, key))).toEqual([1, 1, 1]);
  });

  /**
   * `decoding` requests decode while `arriving` were added before the step and one more (key 9)
   * arrives during it, as its first prefill call begins.
   */
  async function stepWithLateArrival(core: EngineCore, decoding: number[], arriving: number[]) {
    for (const key of decoding) core.add(key, request(`r${key}`), performance.timeOrigin + performance.now());
    await core.step();
    for (const key of arriving) core.add(key, request(`r${key}`), performance.timeOrigin + performance.now());
    const handed: string[][] = [];
    const { events, stats } = await core.step((early) => {
      if (handed.length === 0) core.add(9, request('late'), performance.timeOrigin + performance.now());
      handed.push(early.map(([key, event]) => `${key}:${event.type}`));
    });
    return { handed, events, stats };
  }

  it('with first tokens held, prefills a prompt that arrives during the step too while the held rows outnumber the decoding ones', async () => {
    const { handed, events, stats } = await stepWithLateArrival(newCore({ earlyFirstTokens: 'after-prefills' }), [1], [2, 3]);
    // The late prompt is planned once the step's own prefills are done, and its first token leaves with theirs.
    expect(handed).toEqual([
      ['2:scheduled', '3:scheduled'],
      ['2:text-delta', '3:text-delta', '9:scheduled', '9:text-delta'],
    ]);
    expect(stats).toMatchObject({ phase: 'mixed', prefillCalls: 3, batchSize: 4 });
    expect(stats?.promptTokens).toBe(['r2', 'r3', 'late'].reduce((sum, id) => sum + request(id).promptTokenIds.length, 0));
    // All four decode in the step: the late one takes its second token with the others.
    expect([1, 2, 3, 9].map((key) => tokensOf(events, key))).toEqual([1, 1, 1, 1]);

    // Without an early listener (earlyFirstTokens false) the same, every token with the step's output.
    const held = await stepWithLateArrival(newCore({ earlyFirstTokens: false }), [1], [2, 3]);
    expect(held.handed).toEqual([['2:scheduled', '3:scheduled']]);
    expect([1, 2, 3, 9].map((key) => tokensOf(held.events, key))).toEqual([1, 2, 2, 2]);
  });

  it('leaves a prompt that arrives during the step to the next one when the decoding rows are as many as the held ones, or first tokens leave early', async () => {
    const outnumbered = await stepWithLateArrival(newCore({ earlyFirstTokens: 'after-prefills' }), [1, 2], [3]);
    expect(outnumbered.handed).toEqual([['3:scheduled'], ['3:text-delta']]);
    expect(outnumbered.stats).toMatchObject({ prefillCalls: 1, batchSize: 3 });
    expect(tokensOf(outnumbered.events, 9)).toBe(0);

    const early = await stepWithLateArrival(newCore(), [1], [2, 3]);
    expect(early.handed).toEqual([['2:scheduled', '3:scheduled'], ['2:text-delta'], ['3:text-delta']]);
    expect(early.stats).toMatchObject({ prefillCalls: 2, batchSize: 3 });
    expect(tokensOf(early.events, 9)).toBe(0);
  });

  it('without earlyFirstTokens, hands over only the scheduled events before the first prefill and every token with the step', async () => {
    const { handed, events } = await stepWithNewcomers(newCore({ earlyFirstTokens: false }));
    expect(handed.map((batch) => batch.map(([key, event]) => `${key}:${event.type}`))).toEqual([['2:scheduled', '3:scheduled']]);
    // The newcomers' first and second tokens both come with the step's output, after the decode.
    expect([1, 2, 3].map((key) => tokensOf(events, key))).toEqual([1, 2, 2]);
  });

  it('gives the same tokens with the engine-owned cache as on the present.* fallback, rows joining and leaving', async () => {
    const fallback = await OnnxSession.create({
      modelPath: model.onnxPath,
      executionProvider: 'cpu',
      intraOpThreads: 1,
      interOpThreads: 0,
      newKvOutputs: false,
    });
    try {
      expect(session.outputsNewKv).toBe(true);
      expect(fallback.outputsNewKv).toBe(false);
      const run = async (on: OnnxSession): Promise<number[][]> => {
        const core = new EngineCore(on, model, {
          maxBatchSize: 4,
          maxStepTokens: 64,
          maxCachedTokens: 4 * 2048,
          laneCost: 64,
          exactLengthBatches: false,
          continuationMode: 'replay',
          kvGrowth: 'spread',
          maxPrefillBatch: 1,
          earlyFirstTokens: true,
        });
        const tokens: number[][] = [[], [], [], [], []];
        const lengths = [30, 7, 90, 12, 70];
        for (let step = 0; !core.idle || step < 40; step++) {
          if (step % 8 === 0 && step / 8 < lengths.length) {
            const key = step / 8;
            const id = `req ${key} ${'word '.repeat(key * 9)}`;
            core.add(
              key,
              resolveRequest(
                { id, promptTokenIds: model.tokenizer.encode(id), sampling: { maxTokens: lengths[key]!, temperature: 0, ignoreEos: true } },
                { vocabSize: model.tokenizer.vocabSize, maxContextLength: 2048, maxBatchSize: 4, maxCachedTokens: 4 * 2048 },
              ),
              performance.timeOrigin + performance.now(),
            );
          }
          const { events } = await core.step();
          for (const [key, event] of events) if (event.type === 'text-delta') tokens[key]!.push(...event.tokenIds);
        }
        return tokens;
      };
      const owned = await run(session);
      expect(owned.map((list) => list.length)).toEqual([30, 7, 90, 12, 70]);
      expect(owned).toEqual(await run(fallback));
    } finally {
      await fallback.dispose();
    }
  });
});
