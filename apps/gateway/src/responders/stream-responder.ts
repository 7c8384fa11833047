import type { ServerResponse } from 'node:http';
import { RESPONSE_ALREADY_SENT } from '@hono/node-server/utils/response';
import type { TokenLogprobWire } from '@sluice/protocol';
import { fromWireError, GatewayError, toSseErrorFrames } from '../errors.js';
import type { SessionEvent } from '../request-session.js';
import { isAscii } from '../openai/response-format.js';
import { SseWriter, type HeartbeatTicker } from '../sse-writer.js';
import type { RequestEnd } from '../hooks.js';
import { errorEnd, errorResponse, failedEnd, Outcome, paramRenamer, SUPERSEDED_END, type ResponderContext } from './responder-context.js';

export interface StreamResponderOptions {
  /** Max wait for the worker's accept/reject before the 200 goes out anyway. */
  headersWaitMs: number;
  /** Deltas within this window are written as one chunk (0: each as it comes). */
  streamIntervalMs: number;
  /**
   * Most bytes a stream may hold for a client that does not read (coalesced text + the socket's
   * buffer); beyond, the stream ends as `slow_client`. 0: no bound.
   */
  maxBufferBytes?: number;
  /**
   * The stream gave up on its client (too slow): stop or detach its work, as when a client leaves.
   * @returns whether the work goes on (detached within a resume grace): the end is reported so
   */
  onGiveUp?: () => boolean;
}

/** How long a given-up stream's last bytes may take to leave before its socket is closed. */
const GIVE_UP_CLOSE_MS = 1_000;

/** Rough JSON size of one logprob entry beyond its token text (numbers, keys, bytes array). */
const LOGPROB_OVERHEAD_BYTES = 64;

interface PendingText {
  text: string;
  logprobs: TokenLogprobWire[] | undefined;
}

/**
 * Turns a session's events into an OpenAI SSE stream. Before the 200 is sent, a refusal is still an
 * HTTP error; the 200 goes out when a worker accepts, or after `headersWaitMs` (then heartbeats keep
 * the connection alive while the request waits). After it, a failure is an error frame and `[DONE]`.
 */
export class StreamResponder {
  /** What the route handler returns: an error Response, or "already sent" once the stream owns `res`. */
  readonly reply: Promise<Response>;
  private resolveReply!: (response: Response) => void;
  private phase: 'pending' | 'streaming' | 'done' = 'pending';
  private readonly writer: SseWriter;
  private readonly outcome: Outcome;
  private headersTimer: NodeJS.Timeout | undefined;
  // Coalescing state (streamIntervalMs > 0).
  private readonly pendingText = new Map<number, PendingText>();
  private flushTimer: NodeJS.Timeout | undefined;
  private lastFlushAt = 0;
  /** Tokens of the coalesced text not yet written. */
  private pendingTokens = 0;
  /** Approximate bytes of the coalesced text and logprobs not yet written (the buffer bound). */
  private pendingBytes = 0;
  /** The latest choice's finish reason (with n > 1, the last choice to finish decides). */
  private finishReason: 'stop' | 'length' | 'abort' = 'stop';
  /**
   * The SSE cursor: sequence number of the last entry handled. Every write leaves no coalesced text
   * behind, so the last event of each write completes every entry up to it and carries `id: <seq>`.
   */
  private seq = -1;

  constructor(
    private readonly ctx: ResponderContext,
    res: ServerResponse,
    heartbeats: HeartbeatTicker,
    private readonly options: StreamResponderOptions,
  ) {
    this.writer = new SseWriter(res, heartbeats, ctx.hooks.sseWritten);
    // Backpressure: a socket that does not drain gets coalesced deltas, written at its next drain; one
    // that stalls past the stall timeout (HeartbeatTicker) or the buffer bound is given up on.
    this.writer.onDrain = () => this.flushAll();
    this.writer.onStall = () => this.giveUp('stall');
    this.outcome = new Outcome(ctx);
    this.reply = new Promise((resolve) => (this.resolveReply = resolve));
  }

  get done(): boolean {
    return this.phase === 'done';
  }

  /** The usage so far (completion tokens counted as they arrive): `continuous_usage_stats` reads it. */
  get usage(): { promptTokens: number; completionTokens: number } {
    return { promptTokens: this.outcome.promptTokens, completionTokens: this.outcome.completionTokens };
  }

  /**
   * A resumed stream starts with the usage its earlier events carried (`continuous_usage_stats`
   * counts on from there).
   */
  usageSoFar(usage: { promptTokens: number; completionTokens: number }): void {
    this.outcome.promptTokens = usage.promptTokens;
    this.outcome.completionTokens = usage.completionTokens;
  }

  /** Starts the wait for the worker's decision (the job is enqueued). */
  begin(): void {
    if (this.phase !== 'pending') return;
    if (this.options.headersWaitMs === 0) this.commit();
    else this.headersTimer = setTimeout(() => this.commit(), this.options.headersWaitMs);
  }

  handle(event: SessionEvent): void {
    if (this.phase === 'done') return;
    if (event.type !== 'failed' && event.type !== 'superseded') this.seq = event.seq;
    switch (event.type) {
      case 'accepted': {
        this.outcome.promptTokens = event.promptTokens;
        if (event.continued === true && this.phase !== 'pending') {
          // Another worker took over after a lost one: the stream goes on where it was.
          this.writer.frames(this.idLine() + ': continued\n\n', 0);
          return;
        }
        this.ctx.timing?.accepted();
        this.ctx.observer.accepted();
        if (this.phase === 'pending') this.commit();
        let roles = '';
        const n = this.ctx.request.n;
        for (let index = 0; index < n; index++) {
          const chunk = this.ctx.format.roleChunk(index);
          if (chunk !== undefined) roles += index === n - 1 ? this.idLine() + chunk : chunk;
        }
        this.writer.frames(roles, this.ctx.format.endpoint === 'chat' ? n : 0);
        return;
      }
      case 'scheduled':
        this.ctx.observer.scheduled();
        return;
      case 'text-delta':
        this.outcome.completionTokens += event.tokens;
        if (event.text === '' && event.logprobs === undefined) {
          // Tokens whose text the worker's detokenizer held back to the end: nothing to write.
          this.ctx.observer.tokensWithoutText(event.tokens);
          return;
        }
        this.text(event.index, event.text, event.logprobs, event.tokens);
        return;
      case 'text-end':
        this.flushAll();
        this.writer.frames(this.idLine() + this.ctx.format.finishChunk(event.index, event.finishReason));
        this.finishReason = event.finishReason;
        return;
      case 'finish': {
        this.flushAll();
        this.outcome.promptTokens = event.usage.promptTokens;
        this.phase = 'done';
        this.clearTimers();
        this.writer.done(this.ctx.request.includeUsage ? this.ctx.format.usageChunk(event.usage) : '', this.idLine());
        this.outcome.report(this.finishReason === 'abort' ? { outcome: 'cancelled' } : { outcome: this.finishReason }, 200);
        return;
      }
      case 'rejected':
      case 'error':
        this.fail(fromWireError(event.error, paramRenamer(this.ctx.request)), this.idLine());
        return;
      case 'failed':
        this.fail(event.error, '', failedEnd(event.error, event.detached === true));
        return;
      case 'superseded':
        // The client learns from the error frame that this connection is over; its work goes on.
        this.fail(event.error, '', SUPERSEDED_END);
        return;
    }
  }

  /**
   * A resumed stream whose cursor is already its request's last event (it finished or failed): the
   * 200 and `[DONE]`, nothing else. Reports nothing: the request was counted where it ran.
   */
  endedAtCursor(): void {
    if (this.phase !== 'pending') return;
    this.commit();
    this.phase = 'done';
    this.clearTimers();
    this.writer.done();
  }

  /** The `id:` line of the event that completes the entries handled so far. */
  private idLine(): string {
    return this.seq < 0 ? '' : `id: ${this.seq}\n`;
  }

  /**
   * The client went away: release everything, write nothing.
   * @param detached the request goes on within its resume grace
   */
  clientClosed(detached = false): void {
    if (this.phase === 'done') return;
    const wasPending = this.phase === 'pending';
    this.phase = 'done';
    this.clearTimers();
    this.writer.abandon();
    this.outcome.report({ outcome: 'disconnect', detached }, wasPending ? 499 : 200);
    if (wasPending) this.resolveReply(RESPONSE_ALREADY_SENT);
  }

  private commit(): void {
    if (this.phase !== 'pending') return;
    clearTimeout(this.headersTimer);
    this.phase = 'streaming';
    const timing = this.ctx.timing;
    this.writer.start({
      'X-Request-Id': this.ctx.requestId,
      // The resume and cancel routes' `{id}`, known before any chunk carries it (a completions stream
      // sends none until its first token).
      'X-Stream-Id': this.ctx.format.id,
      ...(timing === undefined ? {} : { 'Server-Timing': timing.header() }),
    });
    this.resolveReply(RESPONSE_ALREADY_SENT);
  }

  /**
   * @param idLine the cursor of a worker's error entry ('' for the gateway's own failures)
   * @param end what to report (the error's own end unless told otherwise)
   */
  private fail(error: GatewayError, idLine: string, end: RequestEnd = errorEnd(error)): void {
    const wasPending = this.phase === 'pending';
    this.phase = 'done';
    this.clearTimers();
    if (wasPending) {
      this.writer.abandon();
      this.resolveReply(errorResponse(error, this.ctx.retryAfterS, this.ctx.requestId));
      this.outcome.report(end, error.status);
      return;
    }
    this.flushAll();
    this.writer.endWith(idLine + toSseErrorFrames(error));
    this.outcome.report(end, 200);
  }

  private text(index: number, text: string, logprobs: TokenLogprobWire[] | undefined, tokens: number): void {
    const interval = this.options.streamIntervalMs;
    // Without a stream interval nothing reads the flush times: no clock read per token.
    const now = interval === 0 ? 0 : Date.now();
    const congested = this.writer.congested;
    if (!congested && (interval === 0 || (this.flushTimer === undefined && now - this.lastFlushAt >= interval))) {
      const ascii = logprobs === undefined && this.ctx.format.asciiHead && isAscii(text);
      this.writer.frames(this.idLine() + this.ctx.format.deltaChunk(index, text, logprobs), 1, ascii);
      this.ctx.observer.contentWritten(tokens);
      this.lastFlushAt = now;
      return;
    }
    // Coalesced text counts when it is written (flushAll/flushChoice).
    this.pendingTokens += tokens;
    this.pendingBytes += text.length + (logprobs === undefined ? 0 : logprobs.reduce((sum, lp) => sum + logprobBytes(lp), 0));
    const pending = this.pendingText.get(index);
    if (pending === undefined) {
      this.pendingText.set(index, { text, logprobs: logprobs === undefined ? undefined : [...logprobs] });
    } else {
      pending.text += text;
      if (logprobs !== undefined) (pending.logprobs ??= []).push(...logprobs);
    }
    const maxBytes = this.options.maxBufferBytes ?? 0;
    if (maxBytes > 0 && this.pendingBytes + this.writer.buffered > maxBytes) {
      this.giveUp('buffer');
      return;
    }
    // A congested socket is written at its next drain; a timer would only find it congested still.
    if (congested) return;
    this.flushTimer ??= setTimeout(
      () => {
        this.flushTimer = undefined;
        if (!this.writer.congested) this.flushAll();
      },
      this.lastFlushAt + interval - now,
    );
  }

  /**
   * The client does not read: its stream ends (an error frame it may never see, then the socket
   * closes), its coalesced text is dropped, and its work stops (or detaches, within a resume grace).
   */
  private giveUp(cause: 'buffer' | 'stall'): void {
    if (this.phase !== 'streaming') return;
    this.phase = 'done';
    this.clearTimers();
    this.pendingText.clear();
    this.pendingBytes = 0;
    this.pendingTokens = 0;
    const error = new GatewayError('client_too_slow', {
      message: cause === 'stall' ? 'The client read nothing for too long.' : 'The client read too slowly: its stream buffer is full.',
    });
    this.writer.endWith(toSseErrorFrames(error));
    // Bytes the client is not reading stay bounded: the socket closes if they do not go out soon.
    const res = this.writer.res;
    if (!res.writableFinished) {
      const timer = setTimeout(() => res.destroy(), GIVE_UP_CLOSE_MS);
      timer.unref();
      res.once('finish', () => clearTimeout(timer));
    }
    const detached = this.options.onGiveUp?.() === true;
    this.outcome.report({ outcome: 'slow_client', cause, detached }, 200);
  }

  private flushAll(): void {
    if (this.pendingText.size === 0) return;
    let frames = '';
    const count = this.pendingText.size;
    let i = 0;
    for (const [index, pending] of this.pendingText) {
      const chunk = this.ctx.format.deltaChunk(index, pending.text, pending.logprobs);
      frames += ++i === count ? this.idLine() + chunk : chunk;
    }
    this.pendingText.clear();
    this.pendingBytes = 0;
    this.writer.frames(frames, count);
    this.lastFlushAt = Date.now();
    this.notePendingWritten();
  }

  private notePendingWritten(): void {
    const tokens = this.pendingTokens;
    this.pendingTokens = 0;
    this.ctx.observer.contentWritten(tokens);
  }

  private clearTimers(): void {
    clearTimeout(this.headersTimer);
    clearTimeout(this.flushTimer);
    this.flushTimer = undefined;
  }
}

function logprobBytes(lp: TokenLogprobWire): number {
  let bytes = lp.token.length + LOGPROB_OVERHEAD_BYTES;
  for (const top of lp.top ?? []) bytes += top.token.length + LOGPROB_OVERHEAD_BYTES;
  return bytes;
}
