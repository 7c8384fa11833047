import type { RequestSession, SessionEvent } from './request-session.js';

/**
 * A completions request with a batch of prompts runs as one job per prompt (the engine serves one
 * prompt per request); this merges their sessions' events into the one reply OpenAI gives:
 * - choice `index` = prompt index × n + choice index;
 * - the first `accepted` starts the reply, with the whole batch's prompt tokens (what every chunk's
 *   `continuous_usage_stats` and the final usage count); later ones add nothing a client sees;
 * - one `finish` once every prompt finished, with the usage summed over the prompts;
 * - the first refusal or failure ends the whole reply and stops the other prompts' work.
 * A batch's events carry no cursor (seq -1): each job keeps its own token log, so a batch's stream is
 * not resumable, and its requests run without a resume grace.
 */
export class PromptBatch {
  readonly sessions: RequestSession[] = [];
  private accepted = false;
  private scheduled = false;
  private finished = 0;
  private promptTokens = 0;
  private completionTokens = 0;
  private ended = false;

  constructor(
    /** Choices per prompt. */
    private readonly n: number,
    /** The prompt tokens of all the prompts together (each counted once, as their `finish` usages are). */
    private readonly batchPromptTokens: number,
    private readonly listener: (event: SessionEvent) => void,
    /** Stops one prompt's work (its client is gone as far as it is concerned). */
    private readonly stop: (session: RequestSession) => void,
  ) {}

  /** The listener of prompt `k`'s session; register the session with {@link add} in the same order. */
  listenerFor(k: number): (event: SessionEvent) => void {
    return (event) => this.handle(k, event);
  }

  add(session: RequestSession): void {
    this.sessions.push(session);
  }

  private handle(k: number, event: SessionEvent): void {
    if (this.ended) return;
    switch (event.type) {
      case 'accepted':
        if (this.accepted) return;
        this.accepted = true;
        this.listener({ ...event, seq: -1, promptTokens: this.batchPromptTokens });
        return;
      case 'scheduled':
        // The batch's queue time ends with its first prompt scheduled.
        if (this.scheduled) return;
        this.scheduled = true;
        this.listener({ ...event, seq: -1 });
        return;
      case 'text-delta':
      case 'text-end':
        this.listener({ ...event, seq: -1, index: k * this.n + event.index });
        return;
      case 'finish':
        this.promptTokens += event.usage.promptTokens;
        this.completionTokens += event.usage.completionTokens;
        if (++this.finished < this.sessions.length) return;
        this.ended = true;
        this.listener({ ...event, seq: -1, usage: { promptTokens: this.promptTokens, completionTokens: this.completionTokens } });
        return;
      case 'failed':
      case 'superseded':
        // (A batch is never resumed, so never superseded; a failure's `detached` passes on as it came.)
        this.end(k, event);
        return;
      case 'rejected':
      case 'error':
        this.end(k, { ...event, seq: -1 });
        return;
    }
  }

  private end(k: number, event: SessionEvent): void {
    this.ended = true;
    this.sessions.forEach((session, j) => {
      if (j !== k) this.stop(session);
    });
    this.listener(event);
  }
}
