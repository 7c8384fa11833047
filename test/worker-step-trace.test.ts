import { describe, expect, it } from 'vitest';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import { waitFor } from './support/processes.js';
import { checkChunkSequence, postRaw } from './support/sse.js';

/**
 * LOG_LEVEL=trace: the worker logs each engine step (what it ran, how long it took), so that a latency
 * spike can be read step by step; at the default level it logs none.
 */
describe.skipIf(FAKE_ENGINE)('worker step trace', () => {
  const isFinished = (line: Record<string, unknown>) => line.msg === 'request finished';

  /** One streamed completion on a fresh stack; the worker's log lines once `until` holds for them. */
  async function complete(
    env: Record<string, string>,
    maxTokens: number,
    until: (lines: Array<Record<string, unknown>>) => boolean,
  ): Promise<Array<Record<string, unknown>>> {
    const cluster = await Cluster.start();
    try {
      const worker = await cluster.worker({ MODEL_ID: MODEL, ...env });
      const gateway = await cluster.gateway();
      const res = await postRaw(`${gateway.url}/v1/completions`, {
        model: MODEL,
        prompt: 'Once upon a time',
        max_tokens: maxTokens,
        temperature: 0,
        ignore_eos: true,
        stream: true,
      });
      expect(res.status, cluster.logs()).toBe(200);
      expect(checkChunkSequence(res.items, 'completion', false).finishReason).toBe('length');
      const lines = () =>
        worker.process
          .output()
          .split('\n')
          .filter((text) => text.startsWith('{'))
          .map((text) => JSON.parse(text) as Record<string, unknown>);
      return await waitFor('the worker log lines', () => {
        const found = lines();
        return until(found) ? found : undefined;
      });
    } finally {
      await cluster.stop();
    }
  }

  it('logs a line per step at LOG_LEVEL=trace: the prompt step, then one decode step per further token', async () => {
    const isStep = (line: Record<string, unknown>) => line.msg === 'step';
    const lines = await complete({ LOG_LEVEL: 'trace' }, 12, (found) => found.filter(isStep).length >= 11 && found.some(isFinished));
    const steps = lines.filter(isStep);
    // The prompt's step gives the first two tokens (its prefill, then its decode); each later step one.
    expect(steps).toHaveLength(11);
    expect(steps[0]).toMatchObject({ phase: 'mixed', prefillCalls: 1, promptTokens: expect.any(Number), generationTokens: 2 });
    expect(steps.slice(1).every((step) => step.phase === 'decode' && step.generationTokens === 1)).toBe(true);
    for (const step of steps) {
      expect(step).toMatchObject({ level: 10, batchSize: 1, stepMs: expect.any(Number), modelMs: expect.any(Number), kvRelayouts: 0 });
    }
  }, 120_000);

  it('logs no steps at the default level', async () => {
    const lines = await complete({ LOG_LEVEL: 'info' }, 4, (found) => found.some(isFinished));
    expect(lines.some((line) => line.msg === 'step')).toBe(false);
  }, 120_000);
});
