import { readdirSync, readFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { ensureBuiltinModel } from '@sluice/model';
import { describe, expect, it } from 'vitest';
import { createEngine, type EngineEvent, type StepStats } from '../src/index.js';
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

  it("runs a step sink: it takes the events it wants, the host gets the rest and every step's numbers, and the two talk", async () => {
    const module = pathToFileURL(new URL('./support/counting-sink.mjs', import.meta.url).pathname).href;
    const engine = await createEngine({
      modelDir: await ensureBuiltinModel('tiny'),
      intraOpThreads: 1,
      stepSink: { module, options: { label: 'counted' } },
    });
    try {
      const sink = engine.sink!;
      const said: unknown[] = [];
      sink.onMessage((message) => said.push(message));
      const steps: StepStats[] = [];
      engine.onStep((stats) => steps.push(stats));
      const events: EngineEvent[] = [];
      engine.onEvents((step) => events.push(...step.map(([, event]) => event)));
      // In order with the submit that follows: the sink has it before the request's first event.
      sink.send({ hello: 1 });
      engine.submit({ id: 'a', promptTokenIds: [3, 4, 5], sampling: { maxTokens: 12, temperature: 0 } });
      await waitUntil(() => said.length === 2);

      expect(said[0]).toEqual({ echo: { hello: 1 } });
      // The sink took every delta: 12 tokens, none of which reached the host.
      expect(said[1]).toMatchObject({ requestId: 'a', tokens: 12, label: 'counted' });
      expect(events.map((event) => event.type)).toEqual(['scheduled', 'text-end', 'finish']);
      // The sink saw each step end (12 tokens: the prompt's step makes two, then one a step), and every
      // step's numbers still reached the host, the last with the finish.
      expect((said[1] as { steps: number }).steps).toBeGreaterThanOrEqual(11);
      expect(steps.length).toBeGreaterThanOrEqual(11);
      expect(steps.reduce((sum, stats) => sum + stats.generationTokens, 0)).toBe(12);
    } finally {
      await engine.close();
    }
  });

  it('has no sink link without a step sink', async () => {
    const engine = await createEngine({ modelDir: await ensureBuiltinModel('tiny'), intraOpThreads: 1 });
    try {
      expect(engine.sink).toBeUndefined();
    } finally {
      await engine.close();
    }
  });
});

async function waitUntil(done: () => boolean): Promise<void> {
  for (let i = 0; i < 500 && !done(); i++) await sleep(10);
  expect(done()).toBe(true);
}
