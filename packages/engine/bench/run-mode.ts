import type { Engine, StepStats } from '../src/index.js';
import type { BenchRequest } from './workload.js';

/**
 * How requests reach the engine:
 * - `sequential`: one request at a time; the next starts when the previous finished.
 * - `static`: request-level batching as a static batch runs it; when the engine is idle, every
 *   request that has arrived (up to the batch size) starts together, every row decodes until the
 *   batch's longest request is done (a static batch keeps finished rows in it), and newcomers wait
 *   for the whole batch. Only each request's own tokens count as output.
 * - `continuous`: every request is handed to the engine the moment it arrives.
 */
export type BenchMode = 'sequential' | 'static' | 'continuous';

export interface ModeResult {
  mode: BenchMode;
  wallMs: number;
  completionTokens: number;
  tokensPerSecond: number;
  /** Arrival → first token event on the host thread, per request. */
  ttftMs: number[];
  /** Submission → first scheduled (engine timings), per request. */
  queueMs: number[];
  steps: StepStats[];
}

export async function runMode(engine: Engine, requests: readonly BenchRequest[], mode: BenchMode, batchSize: number): Promise<ModeResult> {
  const steps: StepStats[] = [];
  const unsubscribe = engine.onStep((stats) => steps.push(stats));
  const start = performance.now();
  const ttftMs: number[] = [];
  const queueMs: number[] = [];
  let completionTokens = 0;

  const runOne = async (request: BenchRequest, rowTokens = request.maxTokens): Promise<void> => {
    let first = true;
    const stream = engine.generate({
      id: request.id,
      promptTokenIds: request.promptTokenIds,
      sampling: { maxTokens: rowTokens, temperature: 0, ignoreEos: true },
    });
    for await (const event of stream) {
      if (event.type === 'text-delta' && first) {
        first = false;
        ttftMs.push(performance.now() - start - request.arrivalMs);
      } else if (event.type === 'finish') {
        if (event.error !== undefined) throw new Error(`${request.id}: ${event.error.message}`);
        completionTokens += Math.min(request.maxTokens, event.usage.completionTokens);
        queueMs.push(event.timings.queueMs);
      }
    }
  };
  const arrived = (request: BenchRequest): Promise<void> =>
    new Promise((resolve) => setTimeout(resolve, Math.max(0, request.arrivalMs - (performance.now() - start))));

  if (mode === 'continuous') {
    await Promise.all(
      requests.map(async (request) => {
        await arrived(request);
        await runOne(request);
      }),
    );
  } else {
    let next = 0;
    while (next < requests.length) {
      await arrived(requests[next]!);
      const now = performance.now() - start;
      const limit = mode === 'sequential' ? 1 : batchSize;
      const batch: BenchRequest[] = [];
      while (next < requests.length && batch.length < limit && requests[next]!.arrivalMs <= now) batch.push(requests[next++]!);
      const rowTokens = Math.max(...batch.map((request) => request.maxTokens));
      await Promise.all(batch.map((request) => runOne(request, rowTokens)));
    }
  }
  unsubscribe();
  const wallMs = performance.now() - start;
  return { mode, wallMs, completionTokens, tokensPerSecond: (completionTokens * 1000) / wallMs, ttftMs, queueMs, steps };
}
