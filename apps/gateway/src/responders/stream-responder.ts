import type { ServerResponse } from 'node:http';
import { RESPONSE_ALREADY_SENT } from '@hono/node-server/utils/response';
import type { TokenLogprobWire } from '@sluice/protocol';
import { fromWireError, toSseErrorFrames, type GatewayError } from '../errors.js';
import type { SessionEvent } from '../request-session.js';
import { SseWriter, type HeartbeatTicker } from '../sse-writer.js';
import { errorResponse, Outcome, paramRenamer, type ResponderContext } from './responder-context.js';

export interface StreamResponderOptions {
  /** Max wait for the worker's accept/reject before the 200 goes out anyway. */
  headersWaitMs: number;
  /** Deltas within this window are written as one chunk (0: each as it comes). */
  streamIntervalMs: number;
}

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
  private lastTextAt = 0;

  constructor(
    private readonly ctx: ResponderContext,
    res: ServerResponse,
    heartbeats: HeartbeatTicker,
    private readonly options: StreamResponderOptions,
  ) {
    this.writer = new SseWriter(res, heartbeats);
    this.outcome = new Outcome(ctx);
    this.reply = new Promise((resolve) => (this.resolveReply = resolve));
  }

  get done(): boolean {
    return this.phase === 'done';
  }

  /** Starts the wait for the worker's decision (the job is enqueued). */
  begin(): void {
    if (this.phase !== 'pending') return;
    if (this.options.headersWaitMs === 0) this.commit();
    else this.headersTimer = setTimeout(() => this.commit(), this.options.headersWaitMs);
  }

  handle(event: SessionEvent): void {
    if (this.phase === 'done') return;
    switch (event.type) {
      case 'accepted': {
        this.outcome.promptTokens = event.promptTokens;
        this.ctx.hooks.requestAccepted?.({ requestId: this.ctx.requestId, queueMs: Date.now() - this.ctx.receivedAt });
        if (this.phase === 'pending') this.commit();
        let roles = '';
        for (let index = 0; index < this.ctx.request.n; index++) roles += this.ctx.format.roleChunk(index) ?? '';
        this.writer.frames(roles);
        return;
      }
      case 'text-delta':
        this.outcome.completionTokens += event.tokens;
        this.text(event.index, event.text, event.logprobs, event.tokens);
        return;
      case 'text-end':
        this.flushChoice(event.index);
        this.writer.frames(this.ctx.format.finishChunk(event.index, event.finishReason));
        return;
      case 'finish': {
        this.flushAll();
        this.outcome.promptTokens = event.usage.promptTokens;
        this.outcome.completionTokens = event.usage.completionTokens;
        this.phase = 'done';
        this.clearTimers();
        this.writer.done(this.ctx.request.includeUsage ? this.ctx.format.usageChunk(event.usage) : '');
        this.outcome.report('ok', 200);
        return;
      }
      case 'rejected':
      case 'error':
        this.fail(fromWireError(event.error, paramRenamer(this.ctx.request)));
        return;
      case 'failed':
        this.fail(event.error);
        return;
    }
  }

  /** The client went away: release everything, write nothing. */
  clientClosed(): void {
    if (this.phase === 'done') return;
    const wasPending = this.phase === 'pending';
    this.phase = 'done';
    this.clearTimers();
    this.writer.abandon();
    this.outcome.report('cancelled', wasPending ? 499 : 200);
    if (wasPending) this.resolveReply(RESPONSE_ALREADY_SENT);
  }

  private commit(): void {
    if (this.phase !== 'pending') return;
    clearTimeout(this.headersTimer);
    this.phase = 'streaming';
    this.writer.start({ 'X-Request-Id': this.ctx.requestId });
    this.resolveReply(RESPONSE_ALREADY_SENT);
  }

  private fail(error: GatewayError): void {
    const wasPending = this.phase === 'pending';
    this.phase = 'done';
    this.clearTimers();
    if (wasPending) {
      this.writer.abandon();
      this.resolveReply(errorResponse(error, this.ctx.retryAfterS));
      this.outcome.report('error', error.status, error);
      return;
    }
    this.flushAll();
    this.writer.endWith(toSseErrorFrames(error));
    this.outcome.report('error', 200, error);
  }

  private text(index: number, text: string, logprobs: TokenLogprobWire[] | undefined, tokens: number): void {
    const now = Date.now();
    const hooks = this.ctx.hooks;
    if (this.lastTextAt === 0) hooks.firstToken?.({ requestId: this.ctx.requestId, ttftMs: now - this.ctx.receivedAt });
    hooks.textDelivered?.(
      this.lastTextAt === 0
        ? { requestId: this.ctx.requestId, tokens }
        : { requestId: this.ctx.requestId, tokens, gapMs: now - this.lastTextAt },
    );
    this.lastTextAt = now;
    const interval = this.options.streamIntervalMs;
    if (interval === 0 || (this.flushTimer === undefined && now - this.lastFlushAt >= interval)) {
      this.writer.frames(this.ctx.format.deltaChunk(index, text, logprobs));
      this.lastFlushAt = now;
      return;
    }
    const pending = this.pendingText.get(index);
    if (pending === undefined) {
      this.pendingText.set(index, { text, logprobs: logprobs === undefined ? undefined : [...logprobs] });
    } else {
      pending.text += text;
      if (logprobs !== undefined) (pending.logprobs ??= []).push(...logprobs);
    }
    this.flushTimer ??= setTimeout(() => {
      this.flushTimer = undefined;
      this.flushAll();
    }, this.lastFlushAt + interval - now);
  }

  private flushChoice(index: number): void {
    const pending = this.pendingText.get(index);
    if (pending === undefined) return;
    this.pendingText.delete(index);
    this.writer.frames(this.ctx.format.deltaChunk(index, pending.text, pending.logprobs));
    this.lastFlushAt = Date.now();
  }

  private flushAll(): void {
    if (this.pendingText.size === 0) return;
    let frames = '';
    for (const [index, pending] of this.pendingText) frames += this.ctx.format.deltaChunk(index, pending.text, pending.logprobs);
    this.pendingText.clear();
    this.writer.frames(frames);
    this.lastFlushAt = Date.now();
  }

  private clearTimers(): void {
    clearTimeout(this.headersTimer);
    clearTimeout(this.flushTimer);
    this.flushTimer = undefined;
  }
}
