import type { Engine, EngineEvent, GenerateRequest, StepEvent, StepStats } from '@sluice/engine';

/**
 * A stand-in engine with the real one's contract (batched steps on a timer, all events of a step in
 * one macrotask, abort at the next step) and deterministic text: token k of a request is
 * ` w<(sum of prompt ids + k) mod 1000>`. For the gateway benchmark (no model cost) and for
 * developing the stream path without a model.
 */
export interface FakeEngineOptions {
  stepMs: number;
  maxBatchSize?: number;
  maxContextLength?: number;
  modelId?: string;
}

interface Active {
  request: GenerateRequest;
  produced: number;
  maxTokens: number;
  seedBase: number;
  push: (event: EngineEvent) => void;
  signal: AbortSignal | undefined;
  startedAt: number;
}

class EventQueue implements AsyncIterableIterator<EngineEvent> {
  private readonly queue: EngineEvent[] = [];
  private waiting: ((result: IteratorResult<EngineEvent>) => void) | undefined;
  private ended = false;

  push(event: EngineEvent): void {
    if (this.ended) return;
    if (event.type === 'finish') this.ended = true;
    const waiting = this.waiting;
    if (waiting !== undefined) {
      this.waiting = undefined;
      waiting({ value: event, done: false });
    } else this.queue.push(event);
  }

  next(): Promise<IteratorResult<EngineEvent>> {
    const event = this.queue.shift();
    if (event !== undefined) return Promise.resolve({ value: event, done: false });
    if (this.ended) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve) => (this.waiting = resolve));
  }

  [Symbol.asyncIterator](): this {
    return this;
  }
}

export function fakeTokenText(seedBase: number, k: number): string {
  return ` w${(seedBase + k) % 1000}`;
}

export function createFakeEngine(options: FakeEngineOptions): Engine {
  const maxBatchSize = options.maxBatchSize ?? 32;
  const active = new Set<Active>();
  const listeners = new Set<(stats: StepStats) => void>();
  const eventListeners = new Set<(events: ReadonlyArray<StepEvent>) => void>();
  /** Events of submitted requests in the current step, delivered together at its end. */
  let stepEvents: StepEvent[] = [];
  let timer: NodeJS.Timeout | undefined;

  const start = (request: GenerateRequest, signal: AbortSignal | undefined, push: (event: EngineEvent) => void) => {
    active.add({
      request,
      produced: 0,
      maxTokens: request.sampling.maxTokens ?? 16,
      seedBase: request.promptTokenIds.reduce((sum, id) => sum + id, 0),
      push,
      signal,
      startedAt: Date.now(),
    });
    timer ??= setInterval(step, options.stepMs);
  };

  const step = () => {
    const started = performance.now();
    let generated = 0;
    for (const a of [...active].slice(0, maxBatchSize)) {
      if (a.signal?.aborted) {
        active.delete(a);
        a.push({ type: 'text-end', index: 0, finishReason: 'abort' });
        a.push({
          type: 'finish',
          usage: { promptTokens: a.request.promptTokenIds.length, completionTokens: a.produced },
          timings: { queueMs: 0, prefillMs: 0, firstTokenMs: 0 },
        });
        continue;
      }
      if (a.produced === 0) a.push({ type: 'scheduled' });
      a.push({ type: 'text-delta', index: 0, tokenIds: [a.produced], text: fakeTokenText(a.seedBase, a.produced) });
      a.produced++;
      generated++;
      if (a.produced >= a.maxTokens) {
        active.delete(a);
        a.push({ type: 'text-end', index: 0, finishReason: 'length' });
        a.push({
          type: 'finish',
          usage: { promptTokens: a.request.promptTokenIds.length, completionTokens: a.produced },
          timings: { queueMs: 0, prefillMs: 0, firstTokenMs: 0 },
        });
      }
    }
    const stats: StepStats = {
      phase: 'decode',
      batchSize: generated,
      stepTokens: generated,
      stepMs: performance.now() - started,
      modelMs: 0,
      running: active.size,
      waiting: 0,
      cachedTokens: 0,
      maxCachedTokens: 1,
      promptTokens: 0,
      prefillCalls: 0,
      promptChunks: 0,
      generationTokens: generated,
      kvRelayouts: 0,
    };
    for (const listener of listeners) listener(stats);
    const events = stepEvents;
    stepEvents = [];
    if (events.length > 0) for (const listener of eventListeners) listener(events);
    if (active.size === 0) {
      clearInterval(timer);
      timer = undefined;
    }
  };

  return {
    info: {
      modelId: options.modelId ?? 'fake',
      maxContextLength: options.maxContextLength ?? 4096,
      maxBatchSize,
      maxCachedTokens: maxBatchSize * (options.maxContextLength ?? 4096),
      executionProvider: 'cpu',
      kvReservedBytes: 0,
      intraOpThreads: 0,
      kvCache: 'engine-owned',
      groupQueryAttention: 'none',
      splitAttentionLayers: 0,
    },
    generate(request, signal) {
      const queue = new EventQueue();
      start(request, signal, (event) => queue.push(event));
      return queue;
    },
    submit(request, signal) {
      start(request, signal, (event) => stepEvents.push([request.id, event]));
    },
    onEvents(listener) {
      eventListeners.add(listener);
      return () => eventListeners.delete(listener);
    },
    onStep(listener) {
      listeners.add(listener);
      return () => listeners.delete(listener);
    },
    // The fake runs on the host thread: it has no thread to lose.
    onDeath: () => () => {},
    async close() {
      clearInterval(timer);
    },
  };
}
