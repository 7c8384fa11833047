import { createHistogram, type RecordableHistogram } from 'node:perf_hooks';

/** One window of the main thread's event-loop delay, in seconds: all 0 for a window with no work. */
export interface EventLoopDelayWindow {
  readonly min: number;
  readonly max: number;
  readonly mean: number;
  readonly stddev: number;
  readonly p50: number;
  readonly p90: number;
  readonly p99: number;
}

const EMPTY_WINDOW: EventLoopDelayWindow = { min: 0, max: 0, mean: 0, stddev: 0, p50: 0, p90: 0, p99: 0 };

/**
 * The main thread's event-loop delay, measured only while the process has work in progress.
 *
 * It measures what prom-client's default metrics measure with `perf_hooks.monitorEventLoopDelay`: a
 * timer every `resolutionMs`, and the time between two of its callbacks (an unloaded loop reads about
 * `resolutionMs`; what a blocked loop adds shows above it). That timer, always on, woke an idle gateway
 * or worker 100 times a second with nothing to measure; this one runs from the first piece of work
 * ({@link begin}) until the last one ends. Node's monitor cannot be paused instead: enabled again, it
 * records the whole pause as one delay, and its `reset()` would drop the window's earlier samples.
 */
export class EventLoopDelay {
  readonly #resolutionMs: number;
  /** Samples since the previous {@link take}, in ns. */
  readonly #window: RecordableHistogram = createHistogram();
  #timer: NodeJS.Timeout | undefined;
  #previousTick = 0n;
  #work = 0;
  #closed = false;

  /** @param resolutionMs the timer's period (prom-client's default, 10 ms, unless a test wants another) */
  constructor(resolutionMs = 10) {
    if (!Number.isInteger(resolutionMs) || resolutionMs < 1) throw new RangeError('resolutionMs must be a whole number ≥ 1');
    this.#resolutionMs = resolutionMs;
  }

  /** Whether the timer runs now (some work is in progress). */
  get measuring(): boolean {
    return this.#timer !== undefined;
  }

  /**
   * A piece of work began (a request, a job): the delay is measured until every begun piece has ended.
   * @returns ends this piece; calling it again does nothing
   */
  begin(): () => void {
    if (this.#work++ === 0) this.#start();
    let ended = false;
    return () => {
      if (ended) return;
      ended = true;
      if (--this.#work === 0) this.#stop();
    };
  }

  /** The window since the previous call (seconds); the next one starts empty. */
  take(): EventLoopDelayWindow {
    const histogram = this.#window;
    const seconds = (ns: number) => ns / 1e9;
    const window: EventLoopDelayWindow =
      histogram.count === 0
        ? EMPTY_WINDOW
        : {
            min: seconds(histogram.min),
            max: seconds(histogram.max),
            mean: seconds(histogram.mean),
            stddev: seconds(histogram.stddev),
            p50: seconds(histogram.percentile(50)),
            p90: seconds(histogram.percentile(90)),
            p99: seconds(histogram.percentile(99)),
          };
    histogram.reset();
    return window;
  }

  /** Stops the timer for good (work begun later is not measured). */
  close(): void {
    this.#closed = true;
    this.#stop();
  }

  #start(): void {
    if (this.#closed) return;
    this.#previousTick = process.hrtime.bigint();
    // Unref'd: measuring never keeps a process alive.
    this.#timer = setInterval(this.#tick, this.#resolutionMs).unref();
  }

  #stop(): void {
    clearInterval(this.#timer);
    this.#timer = undefined;
  }

  readonly #tick = (): void => {
    const now = process.hrtime.bigint();
    const elapsed = now - this.#previousTick;
    this.#previousTick = now;
    // A histogram records values ≥ 1.
    this.#window.record(elapsed > 0n ? elapsed : 1n);
  };
}
