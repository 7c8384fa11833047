import type { EngineErrorCode, EngineEvent, FinishReason } from './types.js';

/**
 * The host-side end of one request: events pushed by the engine thread's step messages, pulled by
 * the caller's `for await`. Events of one step are pushed in one macrotask and resolve pending
 * reads as microtasks, so a caller sees a whole step before any timer or I/O callback runs.
 * A caller that stops reading early (`break`, `return`) cancels the request.
 */
export class RequestStream implements AsyncIterableIterator<EngineEvent> {
  readonly #queue: EngineEvent[] = [];
  readonly #cancel: () => void;
  readonly #promptTokens: number;
  /** Choices not ended yet. */
  readonly #open: Set<number>;
  readonly #submittedAt: number;
  readonly #sink: ((event: EngineEvent) => void) | undefined;
  #completionTokens = 0;
  #waiting: ((result: IteratorResult<EngineEvent>) => void) | undefined;
  /** The finish event was pushed: nothing more will come. */
  #ended = false;
  /** The caller stopped reading. */
  #returned = false;

  /** @param options.sink takes every event instead of the iterator (a submitted request: nobody iterates). */
  /** @param options.choices the choice indexes it carries (default 0..n-1; a continuation's one choice) */
  /** @param options.generatedTokens a continuation's tokens generated before it: its output from the start */
  constructor(options: {
    n: number;
    choices?: number[];
    promptTokens: number;
    generatedTokens?: number;
    submittedAt: number;
    cancel: () => void;
    sink?: (event: EngineEvent) => void;
  }) {
    this.#cancel = options.cancel;
    this.#sink = options.sink;
    this.#promptTokens = options.promptTokens;
    this.#completionTokens = options.generatedTokens ?? 0;
    this.#submittedAt = options.submittedAt;
    this.#open = new Set(options.choices ?? Array.from({ length: options.n }, (_, index) => index));
  }

  push(event: EngineEvent): void {
    if (this.#ended) return;
    if (event.type === 'finish') this.#ended = true;
    else if (event.type === 'text-end') this.#open.delete(event.index);
    else if (event.type === 'text-delta') this.#completionTokens += event.tokenIds.length;
    if (this.#sink !== undefined) return this.#sink(event);
    if (this.#returned) return;
    const waiting = this.#waiting;
    if (waiting !== undefined) {
      this.#waiting = undefined;
      waiting({ value: event, done: false });
    } else {
      this.#queue.push(event);
    }
  }

  /** Ends the stream without the engine (aborted before it was sent, or the engine thread died). */
  endHere(reason: FinishReason, error?: { code: EngineErrorCode; message: string }): void {
    for (const index of [...this.#open]) this.push({ type: 'text-end', index, finishReason: reason });
    const finish: EngineEvent = {
      type: 'finish',
      usage: { promptTokens: this.#promptTokens, completionTokens: this.#completionTokens },
      timings: { queueMs: performance.timeOrigin + performance.now() - this.#submittedAt, prefillMs: 0, firstTokenMs: 0 },
    };
    if (error !== undefined) finish.error = error;
    this.push(finish);
  }

  next(): Promise<IteratorResult<EngineEvent>> {
    const event = this.#queue.shift();
    if (event !== undefined) return Promise.resolve({ value: event, done: false });
    if (this.#ended || this.#returned) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve) => (this.#waiting = resolve));
  }

  return(): Promise<IteratorResult<EngineEvent>> {
    if (!this.#returned) {
      this.#returned = true;
      this.#queue.length = 0;
      if (!this.#ended) this.#cancel();
      this.#waiting?.({ value: undefined, done: true });
      this.#waiting = undefined;
    }
    return Promise.resolve({ value: undefined, done: true });
  }

  [Symbol.asyncIterator](): this {
    return this;
  }
}
