import { RESPONSE_ALREADY_SENT } from '@hono/node-server/utils/response';
import type { TokenLogprobWire } from '@sluice/protocol';
import { fromWireError, type GatewayError } from '../errors.js';
import type { ChoiceResult } from '../openai/response-format.js';
import type { SessionEvent } from '../request-session.js';
import type { RequestEnd } from '../hooks.js';
import { errorEnd, errorResponse, failedEnd, Outcome, paramRenamer, SUPERSEDED_END, type ResponderContext } from './responder-context.js';

/** Collects a whole answer for `stream: false` and replies once, with the complete object or an error. */
export class CompleteResponder {
  readonly reply: Promise<Response>;
  private resolveReply!: (response: Response) => void;
  private finished = false;
  private readonly choices: ChoiceResult[];
  private readonly outcome: Outcome;
  /** The latest choice's finish reason (with n > 1, the last choice to finish decides). */
  private finishReason: 'stop' | 'length' | 'abort' = 'stop';

  constructor(private readonly ctx: ResponderContext) {
    this.outcome = new Outcome(ctx);
    this.reply = new Promise((resolve) => (this.resolveReply = resolve));
    this.choices = Array.from({ length: ctx.request.n }, (_, index) => ({
      index,
      text: ctx.format.echoText(index),
      logprobs: ctx.request.logprobs ? ([] as TokenLogprobWire[]) : undefined,
      finishReason: null,
    }));
  }

  get done(): boolean {
    return this.finished;
  }

  begin(): void {}

  handle(event: SessionEvent): void {
    if (this.finished) return;
    switch (event.type) {
      case 'accepted':
        this.outcome.promptTokens = event.promptTokens;
        // A continuation after a lost worker: the request was accepted long ago.
        if (event.continued !== true) {
          this.ctx.timing?.accepted();
          this.ctx.observer.accepted();
        }
        return;
      case 'scheduled':
        this.ctx.observer.scheduled();
        return;
      case 'text-delta': {
        const choice = this.choices[event.index];
        if (choice === undefined) return;
        this.outcome.completionTokens += event.tokens;
        if (event.text === '' && event.logprobs === undefined) this.ctx.observer.tokensWithoutText(event.tokens);
        else this.ctx.observer.contentWritten(event.tokens);
        choice.text += event.text;
        if (event.logprobs !== undefined) choice.logprobs?.push(...event.logprobs);
        return;
      }
      case 'text-end': {
        const choice = this.choices[event.index];
        if (choice !== undefined) choice.finishReason = event.finishReason;
        this.finishReason = event.finishReason;
        return;
      }
      case 'finish': {
        this.finished = true;
        this.outcome.promptTokens = event.usage.promptTokens;
        const body = this.ctx.format.complete(this.choices, event.usage);
        this.resolveReply(
          new Response(body, {
            status: 200,
            headers: {
              'Content-Type': 'application/json',
              'X-Request-Id': this.ctx.requestId,
              ...(this.ctx.timing === undefined ? {} : { 'Server-Timing': this.ctx.timing.header(performance.now()) }),
            },
          }),
        );
        this.outcome.report(this.finishReason === 'abort' ? { outcome: 'cancelled' } : { outcome: this.finishReason }, 200);
        return;
      }
      case 'rejected':
      case 'error':
        this.fail(fromWireError(event.error, paramRenamer(this.ctx.request)));
        return;
      case 'failed':
        this.fail(event.error, failedEnd(event.error, event.detached === true));
        return;
      case 'superseded':
        // Its id was resumed as a stream on this gateway: the answer goes there now.
        this.fail(event.error, SUPERSEDED_END);
        return;
    }
  }

  clientClosed(): void {
    if (this.finished) return;
    this.finished = true;
    this.outcome.report({ outcome: 'disconnect' }, 499);
    this.resolveReply(RESPONSE_ALREADY_SENT);
  }

  private fail(error: GatewayError, end: RequestEnd = errorEnd(error)): void {
    this.finished = true;
    this.resolveReply(errorResponse(error, this.ctx.retryAfterS, this.ctx.requestId));
    this.outcome.report(end, error.status);
  }
}
