import { readdirSync, readFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import { ensureBuiltinModel } from '@sluice/model';
import { describe, expect, it } from 'vitest';
import { createEngine, type StepStats } from '../src/index.js';
import { collect } from './support/collect.js';

describe('the engine thread', () => {
  it('keeps the host thread free: a timer keeps firing while long steps run', async () => {
    // The bench model prefilling a long prompt in one step: a step far longer than the timer period.
    // One onnxruntime thread leaves the second core to the host (and to whatever else shares this machine).
    const engine = await createEngine({ modelDir: await ensureBuiltinModel('bench'), maxStepTokens: 1024, intraOpThreads: 1 });
    try {
      const steps: StepStats[] = [];
      engine.onStep((stats) => steps.push(stats));
      const ticks: number[] = [];
      const timer = setInterval(() => ticks.push(performance.now()), 5);
      // 1,000 tokens in one step: ~0.3–0.5 s on one thread here, far longer than the 5 ms timer on any machine.
      const promptTokenIds = Array.from({ length: 1000 }, (_, i) => 3 + ((i * 7919) % 4000));
      const result = await collect(engine.generate({ id: 'long', promptTokenIds, sampling: { maxTokens: 2, temperature: 0 } }));
      clearInterval(timer);

      expect(result.finish.usage.completionTokens).toBe(2);
      const longest = Math.max(...steps.map((stats) => stats.stepMs));
      const gaps = ticks.slice(1).map((tick, i) => tick - ticks[i]!);
      // Had the step run on this thread, one gap would be as long as the step.
      expect(longest).toBeGreaterThan(100);
      expect(Math.max(...gaps)).toBeLessThan(longest / 4);
      expect(ticks.length).toBeGreaterThan(longest / 5 / 4);
    } finally {
      await engine.close();
    }
  });

  it.runIf(process.platform === 'linux')('sleeps while the engine is idle: nothing of its own wakes it', async () => {
    // This process's threads, and how often each was woken (voluntary context switches), from /proc.
    const threads = () => readdirSync('/proc/self/task');
    const wakeUps = (id: string) =>
      Number(/voluntary_ctxt_switches:\s+(\d+)/.exec(readFileSync(`/proc/self/task/${id}/status`, 'utf8'))?.[1]);
    const before = new Set(threads());
    const engine = await createEngine({ modelDir: await ensureBuiltinModel('tiny'), intraOpThreads: 1 });
    try {
      await collect(engine.generate({ id: 'once', promptTokenIds: [3, 4, 5], sampling: { maxTokens: 4, temperature: 0 } }));
      // The engine thread and whatever it started (onnxruntime's, libuv's): all idle now.
      const started = threads().filter((id) => !before.has(id));
      expect(started.length).toBeGreaterThan(0);
      await sleep(200);
      const from = started.map(wakeUps);
      await sleep(1_000);
      const woken = started.map((id, i) => wakeUps(id) - from[i]!);
      // Its event-loop monitor's 10 ms timer, left on, woke the engine thread ~100 times a second.
      expect(Math.max(...woken)).toBeLessThan(20);
    } finally {
      await engine.close();
    }
  });
});
