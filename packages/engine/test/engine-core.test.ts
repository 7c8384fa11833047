import { ensureBuiltinModel, loadModelDir, type ModelDir } from '@sluice/model';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { EngineCore } from '../src/engine-core.js';
import { OnnxSession } from '../src/onnx-session.js';
import { resolveRequest } from '../src/resolve-request.js';
import type { EngineEvent } from '../src/types.js';

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

function newCore(): EngineCore {
  return new EngineCore(session, model, { maxBatchSize: 4, maxStepTokens: 64, maxCachedTokens: 4 * 2048, laneCost: 64, exactLengthBatches: false });
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
});
