import type { EntryDraft } from './event-entries.js';

/**
 * What the step router (host thread) tells the thread writer (engine thread) about a request whose
 * step entries the writer writes. Sent through the engine's sink link, in order with its submits.
 */
export type WriterCommand =
  /** Before the submit: take the request's events and keep them (its job's checks are out). */
  | { type: 'hold'; requestId: string }
  /**
   * The checks passed: number `entries` from `nextSeq` (the `accepted`), then what was kept, and write
   * everything of the request from now on, until its finish.
   */
  | {
      type: 'start';
      requestId: string;
      channel: string | null;
      attempt: number;
      nextSeq: number;
      /** ms since epoch: bounds its log's TTL while it runs. */
      deadlineAt: number;
      entries: EntryDraft[];
    }
  /** The submit after `hold` failed: the engine never had the request. */
  | { type: 'forget'; requestId: string }
  /** The checks failed: nothing of it is written (its finish still reaches the host). */
  | { type: 'drop'; requestId: string }
  /** It is being handed over: nothing more of it is written (its finish still reaches the host). */
  | { type: 'stop'; requestId: string }
  /** Its live entries go to `channel` from now on (null: detached, the log only). */
  | { type: 'route'; requestId: string; channel: string | null };

/** What the thread writer tells the step router. */
export type WriterReport =
  /**
   * These requests' finishes went to the host and Redis answered every write of their entries: the host
   * writes what follows (their ends, in one write).
   */
  | { type: 'returned'; requests: ReturnedRequest[] }
  /** An append was fenced out (a newer attempt owns the request): nothing more goes live. */
  | { type: 'fenced'; requestId: string }
  /** Its entries could not be written (Redis away, the connection failed): nothing more is written for it. */
  | { type: 'lost'; requestId: string; why: string }
  /** Redis refused an append of its entries while their publish went out. */
  | { type: 'log-behind'; requestId: string; why: string }
  /** A publish to `channel` reached nobody. */
  | { type: 'unheard'; channel: string };

/** A request the writer gives back to the step router once its finish went to the host. */
export interface ReturnedRequest {
  requestId: string;
  /** The seq of the next entry: the host writes from there. */
  nextSeq: number;
  lastFinishReason?: 'stop' | 'length';
  /** Epoch ms: when its first text reached the writer, and when Redis answered the write carrying it. */
  firstStepAt?: number;
  publishedAt?: number;
}
