import { Worker } from 'node:worker_threads';
import { EngineError } from './engine-error.js';
import type { EngineThreadData, HostMessage, ThreadMessage, ThreadReady } from './engine-protocol.js';
import { RequestStream } from './request-stream.js';
import { resolveRequest, type RequestLimits } from './resolve-request.js';
import type { Engine, EngineEvent, EngineInfo, EngineOptions, GenerateRequest, StepEvent, StepStats } from './types.js';

/**
 * Starts an engine: the model loads and runs in its own worker thread, so the calling thread stays
 * free for I/O during steps. Rejects with EngineError('provider_unavailable') when the execution
 * provider cannot be created.
 */
export async function createEngine(options: EngineOptions): Promise<Engine> {
  checkOptions(options);
  const worker = startEngineThread({ options });
  let settle: { resolve: (ready: ThreadReady) => void; reject: (error: EngineError) => void } | undefined;
  const onMessage = (message: ThreadMessage): void => {
    if (message.type === 'ready') settle?.resolve(message);
    else if (message.type === 'init-error') settle?.reject(new EngineError(message.code, message.message));
  };
  const onError = (cause: Error): void =>
    settle?.reject(new EngineError('internal', `The engine thread failed to start: ${cause.message}`, { cause }));
  const onExit = (code: number): void =>
    settle?.reject(new EngineError('internal', `The engine thread exited during start (code ${code}).`));
  worker.on('message', onMessage).on('error', onError).on('exit', onExit);
  try {
    const ready = await new Promise<ThreadReady>((resolve, reject) => (settle = { resolve, reject }));
    return new ThreadEngine(worker, ready);
  } catch (error) {
    await worker.terminate();
    throw error;
  } finally {
    // Only ours: a Worker keeps internal listeners of its own (removeAllListeners breaks its messages).
    worker.off('message', onMessage).off('error', onError).off('exit', onExit);
  }
}

function checkOptions(options: EngineOptions): void {
  const positive = ['maxBatchSize', 'maxStepTokens', 'maxCachedTokens', 'maxPrefillBatch'] as const;
  for (const field of positive) {
    const value = options[field];
    if (value !== undefined && !(Number.isInteger(value) && value >= 1)) {
      throw new EngineError('invalid_request', `EngineOptions.${field} must be an integer ≥ 1, got ${String(value)}.`);
    }
  }
  for (const field of ['intraOpThreads', 'interOpThreads'] as const) {
    const value = options[field];
    if (value !== undefined && !(Number.isInteger(value) && value >= 0)) {
      throw new EngineError('invalid_request', `EngineOptions.${field} must be an integer ≥ 0, got ${String(value)}.`);
    }
  }
  if ((options.maxStepTokens ?? 512) < (options.maxBatchSize ?? 32)) {
    // Otherwise a full batch's decode tokens alone would exceed the step budget.
    throw new EngineError('invalid_request', 'EngineOptions.maxStepTokens must be ≥ maxBatchSize.');
  }
  if (options.continuationMode !== undefined && !['replay', 'prefill'].includes(options.continuationMode)) {
    throw new EngineError(
      'invalid_request',
      `EngineOptions.continuationMode must be replay or prefill, got ${String(options.continuationMode)}.`,
    );
  }
  if (options.gqaAttention !== undefined && !['op', 'decomposed'].includes(options.gqaAttention)) {
    throw new EngineError('invalid_request', `EngineOptions.gqaAttention must be op or decomposed, got ${String(options.gqaAttention)}.`);
  }
  if (options.kvGrowth !== undefined && !['spread', 'in-place'].includes(options.kvGrowth)) {
    throw new EngineError('invalid_request', `EngineOptions.kvGrowth must be spread or in-place, got ${String(options.kvGrowth)}.`);
  }
  for (const name of ['kvPreallocate', 'weightsInPlace'] as const) {
    if (options[name] !== undefined && typeof options[name] !== 'boolean') {
      throw new EngineError('invalid_request', `EngineOptions.${name} must be a boolean, got ${String(options[name])}.`);
    }
  }
  // Options that take a boolean or one named mode.
  const modes = [
    ['earlyFirstTokens', 'after-prefills'],
    ['intraOpSpinning', 'during-run'],
  ] as const;
  for (const [field, mode] of modes) {
    const value = options[field];
    if (value !== undefined && typeof value !== 'boolean' && value !== mode) {
      throw new EngineError('invalid_request', `EngineOptions.${field} must be true, false or '${mode}', got ${String(value)}.`);
    }
  }
  const provider = options.executionProvider ?? 'cpu';
  if (!['cpu', 'cuda', 'webgpu'].includes(provider)) {
    throw new EngineError('invalid_request', `EngineOptions.executionProvider must be cpu, cuda or webgpu, got ${String(provider)}.`);
  }
}

/**
 * The engine thread's script next to this file: the compiled `.js` in a build. When this module
 * itself runs from TypeScript sources (vitest, tsx), the thread loads `engine-thread.ts` through
 * tsx's loader, registered inside the thread: Node 20 ignores `--import` in a worker's execArgv.
 */
function startEngineThread(data: EngineThreadData): Worker {
  if (!import.meta.url.endsWith('.ts')) return new Worker(new URL('./engine-thread.js', import.meta.url), { workerData: data });
  const script = new URL('./engine-thread.ts', import.meta.url).href;
  const bootstrap = `import('tsx/esm/api').then((tsx) => { tsx.register(); return import(${JSON.stringify(script)}); })`;
  return new Worker(bootstrap, { eval: true, workerData: data });
}

class ThreadEngine implements Engine {
  readonly info: EngineInfo;
  readonly #worker: Worker;
  readonly #limits: RequestLimits;
  readonly #requests = new Map<number, { stream: RequestStream; release: () => void }>();
  readonly #stepListeners = new Set<(stats: StepStats) => void>();
  readonly #eventListeners = new Set<(events: ReadonlyArray<StepEvent>) => void>();
  readonly #deathListeners = new Set<(reason: string) => void>();
  /** Events of submitted requests of the step being delivered; handed over in one microtask. */
  #stepEvents: StepEvent[] = [];
  #nextKey = 1;
  #closed: Promise<void> | undefined;
  #dead = false;

  constructor(worker: Worker, ready: ThreadReady) {
    this.#worker = worker;
    this.info = ready.info;
    this.#limits = {
      vocabSize: ready.vocabSize,
      maxContextLength: ready.info.maxContextLength,
      maxBatchSize: ready.info.maxBatchSize,
      maxCachedTokens: ready.maxCachedTokens,
    };
    worker.on('message', (message: ThreadMessage) => this.#onMessage(message));
    worker.on('error', (cause) => this.#onDeath(`The engine thread failed: ${cause.message}`));
    worker.on('exit', (code) => this.#onDeath(`The engine thread exited (code ${code}).`));
  }

  generate(request: GenerateRequest, signal?: AbortSignal): AsyncIterable<EngineEvent> {
    return this.#start(request, signal, undefined);
  }

  submit(request: GenerateRequest, signal?: AbortSignal): void {
    const id = request.id;
    this.#start(request, signal, (event) => this.#emit(id, event));
  }

  onEvents(listener: (events: ReadonlyArray<StepEvent>) => void): () => void {
    this.#eventListeners.add(listener);
    return () => this.#eventListeners.delete(listener);
  }

  #start(request: GenerateRequest, signal: AbortSignal | undefined, sink: ((event: EngineEvent) => void) | undefined): RequestStream {
    if (this.#closed !== undefined || this.#dead) throw new EngineError('engine_closed', 'The engine is closed.');
    const resolved = resolveRequest(request, this.#limits);
    const key = this.#nextKey++;
    const submittedAt = performance.timeOrigin + performance.now();
    const onAbort = (): void => this.#post({ type: 'abort', key });
    const stream = new RequestStream({
      n: resolved.sampling.n,
      ...(resolved.continuation === undefined ? {} : { choices: [resolved.continuation.choiceIndex] }),
      promptTokens: resolved.promptTokenIds.length,
      generatedTokens: resolved.continuation?.generatedTokenIds.length ?? 0,
      submittedAt,
      cancel: onAbort,
      ...(sink === undefined ? {} : { sink }),
    });
    if (signal?.aborted) {
      stream.endHere('abort');
      return stream;
    }
    signal?.addEventListener('abort', onAbort, { once: true });
    this.#requests.set(key, { stream, release: () => signal?.removeEventListener('abort', onAbort) });
    this.#post({ type: 'add', key, request: resolved, submittedAt });
    return stream;
  }

  onStep(listener: (stats: StepStats) => void): () => void {
    this.#stepListeners.add(listener);
    return () => this.#stepListeners.delete(listener);
  }

  onDeath(listener: (reason: string) => void): () => void {
    this.#deathListeners.add(listener);
    return () => this.#deathListeners.delete(listener);
  }

  close(): Promise<void> {
    this.#closed ??= this.#close();
    return this.#closed;
  }

  async #close(): Promise<void> {
    if (this.#dead) return;
    const closed = new Promise<void>((resolve) => {
      this.#worker.on('message', (message: ThreadMessage) => {
        if (message.type === 'closed') resolve();
      });
      this.#worker.once('exit', () => resolve());
    });
    this.#post({ type: 'close' });
    await closed;
    this.#dead = true;
    await this.#worker.terminate();
  }

  /** Collects a submitted request's event; the step's events reach the listeners together. */
  #emit(requestId: string, event: EngineEvent): void {
    if (this.#stepEvents.length === 0) queueMicrotask(() => this.#deliverEvents());
    this.#stepEvents.push([requestId, event]);
  }

  #deliverEvents(): void {
    const events = this.#stepEvents;
    this.#stepEvents = [];
    for (const listener of this.#eventListeners) {
      try {
        listener(events);
      } catch {
        // One failing listener must not starve the others.
      }
    }
  }

  #post(message: HostMessage): void {
    if (!this.#dead) this.#worker.postMessage(message);
  }

  #onMessage(message: ThreadMessage): void {
    if (message.type !== 'step') return;
    for (const [key, event] of message.events) {
      const request = this.#requests.get(key);
      if (request === undefined) continue;
      request.stream.push(event);
      if (event.type === 'finish') {
        this.#requests.delete(key);
        request.release();
      }
    }
    if (message.stats !== undefined) {
      for (const listener of this.#stepListeners) {
        try {
          listener(message.stats);
        } catch {
          // A failing metrics listener must not break the stream path.
        }
      }
    }
  }

  /** The thread is gone: every open request ends with an error instead of hanging. */
  #onDeath(message: string): void {
    if (this.#dead) return;
    this.#dead = true;
    if (this.#closed === undefined) {
      for (const listener of this.#deathListeners) {
        try {
          listener(message);
        } catch {
          // The requests below must still end.
        }
      }
    }
    for (const { stream, release } of this.#requests.values()) {
      stream.endHere('error', { code: this.#closed === undefined ? 'internal' : 'engine_closed', message });
      release();
    }
    this.#requests.clear();
  }
}
