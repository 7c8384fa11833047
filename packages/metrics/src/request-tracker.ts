import type { Counter, Gauge, Histogram } from 'prom-client';
import { eventLoopTurn } from './event-loop-turn.js';

/** Where a request is when the client leaves: waiting for a worker, prefilling, or decoding. */
export type RequestStage = 'queued' | 'prefill' | 'decode';

/** How an accepted request ended, as `sluice_gateway_request_outcomes_total{outcome}` counts it. */
/** `cancelled`: ended by `POST .../{id}/cancel` (finish reason `abort`); `detached`: its client left with a resume grace. */
/** `slow_client`: the client did not read its stream (buffer bound or stall timeout): ended and its work stopped. */
export type RequestOutcome = 'stop' | 'length' | 'cancelled' | 'detached' | 'disconnect' | 'timeout' | 'slow_client' | 'error';

/** Which deadline passed: waiting for a worker, between tokens, or the whole request's. */
export type TimeoutKind = 'queue' | 'idle' | 'deadline';

/** Why the gateway gave up on a client that did not read: its buffer bound, or the stall timeout. */
export type SlowClientCause = 'buffer' | 'stall';

/**
 * The gateway instruments a tracker writes to. Those called per step of a stream (tokens, TTFT, ITL)
 * are plain local accumulators, folded into prom-client when a scrape reads them: the write path never
 * calls prom-client per token. The rest run once per request.
 */
export interface RequestInstruments {
  activeStreams: Gauge;
  timeToFirstToken: { observe(seconds: number): void };
  interTokenLatency: { observe(seconds: number): void };
  e2eRequestLatency: Histogram;
  requestQueueTime: Histogram;
  requestOutcomes: Counter<'outcome'>;
  disconnects: Counter<'stage'>;
  timeouts: Counter<'kind'>;
  slowClients: Counter<'cause'>;
  streamErrors: Counter<'code'>;
  streamTokens: { inc(tokens: number): void };
}

/**
 * Times one accepted request through the gateway. Made by `GatewayMetrics.trackRequest()`.
 *
 * The first of `finish`, `disconnect`, `timeout` and `fail` ends the request; later calls are ignored,
 * so an abort handler that fires after the final frame cannot count the request twice.
 */
export class RequestTracker {
  readonly #instruments: RequestInstruments;
  readonly #now: () => number;
  #stage: RequestStage = 'queued';
  #lastContentAt: number | undefined;
  #lastContentTurn = -1;
  #ended = false;

  constructor(
    instruments: RequestInstruments,
    now: () => number,
    /** Whether the client asked for an SSE stream. */
    readonly stream: boolean,
    /** When the request was received, on the `now` clock (ms). */
    readonly receivedAt: number,
  ) {
    this.#instruments = instruments;
    this.#now = now;
    if (stream) instruments.activeStreams.inc();
  }

  get stage(): RequestStage {
    return this.#stage;
  }

  get ended(): boolean {
    return this.#ended;
  }

  /**
   * A worker began the request (the gateway saw its first message for it). Records the queue time.
   * If content arrives without this call, the request still moves on, but no queue time is recorded:
   * a guess would mix prefill into it.
   */
  started(): void {
    if (this.#ended || this.#stage !== 'queued') return;
    this.#stage = 'prefill';
    this.#instruments.requestQueueTime.observe(this.#secondsSince(this.receivedAt));
  }

  /**
   * Content carrying `tokens` completion tokens was written to the client (call it per chunk). The
   * first call records the time to first token; the first call of each later event-loop turn records
   * the inter-token latency: the chunks of one engine step (one per choice when n > 1) arrive in one
   * gateway message, delivered in one turn, so ITL counts steps, as vLLM's does, and adds no zero gaps.
   * Calls with no tokens (the role-only first chunk) are ignored: they are not content.
   */
  contentWritten(tokens: number): void {
    if (this.#ended || tokens <= 0) return;
    const at = this.#now();
    const turn = eventLoopTurn();
    this.#instruments.streamTokens.inc(tokens);
    if (this.stream) {
      if (this.#lastContentAt === undefined) {
        this.#instruments.timeToFirstToken.observe(toSeconds(at - this.receivedAt));
      } else if (turn !== this.#lastContentTurn) {
        this.#instruments.interTokenLatency.observe(toSeconds(at - this.#lastContentAt));
      }
    }
    this.#lastContentAt = at;
    this.#lastContentTurn = turn;
    this.#stage = 'decode';
  }

  /**
   * Completion tokens that reached the client without visible text (the detokenizer held their bytes
   * back to the end). Counted with the tokens written, not timed: no content was written.
   */
  tokensWithoutText(tokens: number): void {
    if (this.#ended || tokens <= 0) return;
    this.#instruments.streamTokens.inc(tokens);
  }

  /**
   * The answer is complete (finish reason `stop` or `length`, or `abort`: cancelled) and its last byte
   * was written. The end-to-end latency is of whole answers only (a cancelled one is cut short).
   */
  finish(reason: 'stop' | 'length' | 'cancelled'): void {
    if (!this.#end(reason)) return;
    if (reason !== 'cancelled') this.#instruments.e2eRequestLatency.observe(this.#secondsSince(this.receivedAt));
  }

  /**
   * The client went away before the request ended. Counted by the stage the request was in.
   * @param detached the request goes on within its resume grace (not a disconnect that stops the work)
   */
  disconnect(detached = false): void {
    const stage = this.#stage;
    if (!this.#end(detached ? 'detached' : 'disconnect')) return;
    this.#instruments.disconnects.labels(stage).inc();
  }

  /** The gateway ended the request because a deadline of this `kind` passed: `queue`, `idle` or `deadline`. */
  timeout(kind: TimeoutKind): void {
    if (!this.#end('timeout')) return;
    this.#instruments.timeouts.labels(kind).inc();
  }

  /** The gateway gave up on a client that did not read: `buffer` (MAX_STREAM_BUFFER_BYTES) or `stall` (CLIENT_STALL_TIMEOUT_MS). */
  slowClient(cause: SlowClientCause): void {
    if (!this.#end('slow_client')) return;
    this.#instruments.slowClients.labels(cause).inc();
  }

  /**
   * The request ended in an error other than a timeout, with this code (`worker_lost`,
   * `stream_interrupted`, ...).
   * @param detached only this delivery ended (its client got the error frame) while the work goes on
   *   for a resume: a draining gateway's `shutting_down` with a grace. Its outcome is `detached`, not
   *   `error`: a redeploy must not count as failed requests (the error-ratio alert).
   */
  fail(code: string, detached = false): void {
    if (!this.#end(detached ? 'detached' : 'error')) return;
    this.#instruments.streamErrors.labels(code).inc();
  }

  #end(outcome: RequestOutcome): boolean {
    if (this.#ended) return false;
    this.#ended = true;
    this.#instruments.requestOutcomes.labels(outcome).inc();
    if (this.stream) this.#instruments.activeStreams.dec();
    return true;
  }

  #secondsSince(start: number): number {
    return toSeconds(this.#now() - start);
  }
}

function toSeconds(ms: number): number {
  return Math.max(0, ms) / 1000;
}
