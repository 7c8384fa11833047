import { randomUUID } from 'node:crypto';
import type { ServerResponse } from 'node:http';
import type { Logger } from 'pino';
import type { RequestScripts } from '@sluice/protocol';
import { GatewayError } from '../errors.js';
import { workGoesOn, type RequestObserver } from '../hooks.js';
import type { ParsedRequest } from '../openai/request-schemas.js';
import type { AuthenticatedKey } from './auth-middleware.js';
import type { KeyUsageRecorder } from './key-usage-recorder.js';
import type { LimitState, RateLimiter } from './rate-limiter.js';
import type { CheckedPrompt } from '../prompt-tokens.js';
import { tokenReservation } from './token-reservation.js';

/** OpenAI's duration format of the `x-ratelimit-reset-*` headers: `20ms`, `1.5s`, `6m0s`. */
export function formatReset(ms: number): string {
  const clamped = Math.max(0, Math.ceil(ms));
  if (clamped < 1000) return `${clamped}ms`;
  const seconds = clamped / 1000;
  if (seconds < 60) return `${Number(seconds.toFixed(3))}s`;
  const minutes = Math.floor(seconds / 60);
  return `${minutes}m${Number((seconds - minutes * 60).toFixed(3))}s`;
}

/** The `x-ratelimit-*` headers of a key's limits after a decision; a limit the key lacks has none. */
export function rateLimitHeaders(state: LimitState): Record<string, string> {
  const headers: Record<string, string> = {};
  const { rpm, tpm } = state.limits;
  if (rpm !== undefined) {
    headers['x-ratelimit-limit-requests'] = String(rpm);
    headers['x-ratelimit-remaining-requests'] = String(Math.max(0, rpm - state.requestsUsed));
    headers['x-ratelimit-reset-requests'] = formatReset(state.requestsResetMs);
  }
  if (tpm !== undefined) {
    headers['x-ratelimit-limit-tokens'] = String(tpm);
    headers['x-ratelimit-remaining-tokens'] = String(Math.max(0, tpm - state.tokensUsed));
    headers['x-ratelimit-reset-tokens'] = formatReset(state.tokensResetMs);
  }
  return headers;
}

/** How long a stream slot outlives what holds it (a detached request's grace, a resumed one's deadline). */
const SLOT_SLACK_MS = 1_000;

/** What a granted request holds until it ends. */
export interface KeyGrant {
  readonly key: AuthenticatedKey;
  readonly requestId: string;
  readonly reservedTokens: number;
  /** The admitted delivery's token on its stream slot (rate-limiter.ts): a resume's claim replaces it. */
  readonly slotOwner: string;
}

/**
 * Admission of one request under its key: the allowed models (403), a reservation larger than the
 * key's whole TPM (400), then the key's limits in one atomic step (429 with Retry-After), and, when the request ends, the settlement of its tokens and
 * the release of its stream slot. Every ending passes through the request's observer's `finished`,
 * which `observe` wraps, so no ending can leak a reservation.
 */
export class KeyAdmission {
  readonly #limiter: RateLimiter;
  readonly #usage: KeyUsageRecorder;
  readonly #logger: Logger;
  readonly #leaseMs: number;
  readonly #scripts: RequestScripts;

  /** @param scripts records each delivery's usage in the request's meta, so that a resumed stream's tokens count once */
  constructor(limiter: RateLimiter, usage: KeyUsageRecorder, logger: Logger, leaseMs: number, scripts: RequestScripts) {
    this.#limiter = limiter;
    this.#usage = usage;
    this.#logger = logger;
    this.#leaseMs = leaseMs;
    this.#scripts = scripts;
  }

  /** 403 unless the key may use `model`. */
  checkModel(key: AuthenticatedKey, model: string): void {
    const { models, name } = key.record;
    if (models === undefined || models.includes(model)) return;
    this.#usage.refused(name, 'model');
    throw new GatewayError('model_not_allowed', { message: `This API key may not use the model "${model}".`, param: 'model' });
  }

  /**
   * Admits `request` for `key` or throws the refusal. The `x-ratelimit-*` headers go on `res` either
   * way (Node merges them into whatever head is written later: a stream's, a JSON reply's, a 429's).
   */
  async admit(
    key: AuthenticatedKey,
    request: ParsedRequest,
    prompts: ReadonlyArray<Pick<CheckedPrompt, 'ids' | 'maxTokens'>>,
    requestId: string,
    res: ServerResponse,
  ): Promise<KeyGrant> {
    const { record } = key;
    this.checkModel(key, request.model);
    const { limits } = record;
    const reservedTokens = limits.tpm === undefined ? 0 : tokenReservation(request.n, prompts);
    if (limits.tpm !== undefined && reservedTokens > limits.tpm) {
      // It could never pass: no window is ever empty enough. A 400, so that no client retries it.
      // Its own reason: `tokens` is the 429 of a window too full for now.
      this.#usage.refused(record.name, 'tokens_over_limit');
      const promptTokens = prompts.reduce((sum, prompt) => sum + prompt.ids.length, 0);
      const byPrompt = promptTokens > limits.tpm;
      throw new GatewayError('tokens_over_key_limit', {
        message: byPrompt
          ? `The prompt has ${promptTokens} tokens, more than this key's ${limits.tpm} tokens per minute.`
          : `This request may use up to ${reservedTokens} tokens (prompt + max_tokens × n), more than this key's ${limits.tpm} tokens per minute. Lower ${request.maxTokensParam}.`,
        param: byPrompt ? (request.endpoint === 'chat' ? 'messages' : 'prompt') : request.maxTokensParam,
      });
    }
    const slotOwner = randomUUID();
    if (limits.rpm === undefined && limits.tpm === undefined && limits.maxStreams === undefined) {
      this.#usage.admitted(record.name);
      return { key, requestId, reservedTokens, slotOwner };
    }
    let admission;
    try {
      admission = await this.#limiter.admit(key.hash, limits, requestId, reservedTokens, this.#leaseMs, slotOwner);
    } catch (error) {
      throw new GatewayError('store_unavailable', { message: 'The rate limiter is unavailable.', cause: error });
    }
    for (const [name, value] of Object.entries(rateLimitHeaders(admission.state))) res.setHeader(name, value);
    if (!admission.admitted) {
      this.#usage.refused(record.name, admission.refused);
      const retryAfterS = Math.max(1, Math.ceil(admission.retryAfterMs / 1000));
      const message =
        admission.refused === 'streams'
          ? `This API key has ${limits.maxStreams} requests in flight already (max-streams). Retry when one ends.`
          : `Rate limit reached for this API key: ${admission.refused === 'requests' ? `${limits.rpm} requests` : `${limits.tpm} tokens`} per minute. Retry after ${retryAfterS} s.`;
      throw new GatewayError('rate_limit_exceeded', { message, retryAfterS });
    }
    this.#usage.admitted(record.name);
    return { key, requestId, reservedTokens, slotOwner };
  }

  /**
   * The request's observer, plus the settlement when it finishes: tokens settle to prompt +
   * completion tokens as the responder counted them. A delivery whose work goes on (its end is
   * `detached`: a client that left within its resume grace, a slow client detached so, a stream a
   * draining gateway left for a resume elsewhere, a stream taken over by a resume here) keeps the whole
   * reservation, and the stream slot for the grace, as its work goes on unseen. A resume claims the
   * slot ({@link resumed}); from then on this delivery's settlement leaves the slot alone.
   * @param graceMs the request's resume grace
   */
  observe(grant: KeyGrant, observer: RequestObserver, graceMs = 0): RequestObserver {
    let settled = false;
    return {
      accepted: () => observer.accepted(),
      scheduled: () => observer.scheduled(),
      contentWritten: (tokens) => observer.contentWritten(tokens),
      tokensWithoutText: (tokens) => observer.tokensWithoutText(tokens),
      finished: (info) => {
        observer.finished(info);
        if (settled) return;
        settled = true;
        const detached = workGoesOn(info.end);
        const used = detached ? grant.reservedTokens : info.promptTokens + info.completionTokens;
        this.recordUsage(grant.key.record.name, grant.requestId, info.promptTokens, info.completionTokens);
        this.settle(grant, used, detached ? graceMs + SLOT_SLACK_MS : 0);
      },
    };
  }

  /** A grant whose request was never enqueued (its client left meanwhile): all it holds goes back. */
  release(grant: KeyGrant): void {
    this.settle(grant, 0, 0);
  }

  /**
   * A stream of `key`'s request resumed here: this delivery claims the request's stream slot with a
   * token of its own and holds it until the request's deadline, whichever delivery held it before
   * (their later endings no longer touch it). When the stream ends the slot is freed (or held for the
   * grace when its work goes on: `detached`), unless a newer resume claimed it meanwhile; and the
   * tokens it delivered that no earlier delivery recorded count under the key. Its token reservation
   * is the admission's, kept whole by a delivery that detached; a resumed delivery that sees the
   * request end settles it to the request's real usage (settling is idempotent: every resume that sees
   * the end sets the same total).
   * @returns the observer of the resumed stream's ending (its usage: totals through its last event)
   */
  resumed(key: AuthenticatedKey, requestId: string, deadlineAt: number, graceMs: number): RequestObserver['finished'] {
    const owner = randomUUID();
    const { maxStreams, tpm } = key.record.limits;
    const slots = maxStreams !== undefined;
    const failed = (error: unknown) => this.#logger.warn({ err: error, requestId }, 'holding a resumed stream slot failed');
    if (slots || tpm !== undefined) {
      void this.#limiter.claim(key.hash, requestId, owner, Math.max(1, deadlineAt - Date.now()) + SLOT_SLACK_MS, slots).catch(failed);
    }
    return (info) => {
      if (workGoesOn(info.end)) {
        if (slots) void this.#limiter.hold(key.hash, requestId, owner, graceMs + SLOT_SLACK_MS).catch(failed);
      } else if (tpm !== undefined) {
        // The request ended: its reservation becomes its usage, and the slot (if this delivery holds it) is freed.
        void this.#limiter.settle(key.hash, requestId, owner, info.promptTokens + info.completionTokens, 0).catch(failed);
      } else if (slots) {
        void this.#limiter.hold(key.hash, requestId, owner, 0).catch(failed);
      }
      this.recordUsage(key.record.name, requestId, info.promptTokens, info.completionTokens);
    };
  }

  /** Counts under the key the part of a delivery's usage (totals) that no other delivery of the request recorded. */
  private recordUsage(name: string, requestId: string, promptTokens: number, completionTokens: number): void {
    if (promptTokens === 0 && completionTokens === 0) return;
    this.#scripts.recordUsage(requestId, promptTokens, completionTokens).then(
      (fresh) => this.#usage.used(name, fresh.promptTokens, fresh.completionTokens),
      (error: unknown) => {
        // Counted rather than lost: a later resume of this request may count its tokens again.
        this.#logger.warn({ err: error, key: name, requestId }, 'recording usage in the request meta failed');
        this.#usage.used(name, promptTokens, completionTokens);
      },
    );
  }

  private settle(grant: KeyGrant, used: number, holdMs: number): void {
    const { limits, name } = grant.key.record;
    if (limits.tpm === undefined && limits.maxStreams === undefined) return;
    this.#limiter.settle(grant.key.hash, grant.requestId, grant.slotOwner, limits.tpm === undefined ? 0 : used, holdMs).then(
      (delta) => {
        if (delta > 0)
          this.#logger.warn(
            { key: name, requestId: grant.requestId, reserved: grant.reservedTokens, used },
            'a request used more tokens than it reserved',
          );
      },
      (error: unknown) => this.#logger.warn({ err: error, key: name, requestId: grant.requestId }, 'rate limit settlement failed'),
    );
  }
}
