import type { GatewayEntry, RequestMeta } from '@sluice/protocol';
import type { AppDeps } from './app.js';
import type { AuthenticatedKey } from './auth/auth-middleware.js';
import type { KeyAdmission } from './auth/key-admission.js';
import type { ClientPresence } from './client-presence.js';
import { GatewayError } from './errors.js';
import type { GatewayHooks, RequestObserver } from './hooks.js';
import type { RequestSession, SessionEvent } from './request-session.js';
import { noObserver } from './responders/responder-context.js';

/** What a taken-over delivery writes to: a resumed stream, or a replayed request's stream or JSON reply. */
export interface TakingResponder {
  readonly done: boolean;
  begin(): void;
  handle(event: SessionEvent): void;
  /** @param detached the work goes on without this connection (a resume grace) */
  clientClosed(detached: boolean): void;
}

/** What a taken-over delivery gives back when it ends: filled in as the takeover proceeds. */
export interface DeliveryEndings {
  /** A stream: its place among the gateway's active streams. */
  active?: (() => void) | undefined;
  /** Under a key: the request's stream slot and token reservation, held by this delivery once attached. */
  slot?: RequestObserver['finished'] | undefined;
}

/**
 * The observer of a taken-over delivery (a resume, a replay): its request was counted where it was
 * admitted, so only the tokens it writes count here, and its end gives back what `endings` holds then.
 */
export function takenOverObserver(hooks: GatewayHooks, endings: DeliveryEndings): RequestObserver {
  return {
    ...noObserver(),
    contentWritten: (tokens) => hooks.resumedTokensWritten?.(tokens),
    tokensWithoutText: (tokens) => hooks.resumedTokensWritten?.(tokens),
    finished: (info) => {
      endings.active?.();
      endings.slot?.(info);
    },
  };
}

export interface TakeOverOptions {
  jobId: string;
  meta: RequestMeta;
  /** The last event the client has (-1: none). */
  cursor: number;
  /** The log's last entry when the meta was read. */
  last: GatewayEntry | undefined;
  responder: TakingResponder;
  client: ClientPresence;
  /** The API key that made the request (see resume.ts ownedByCaller), and its limits when they are on. */
  key: AuthenticatedKey | undefined;
  admission: KeyAdmission | undefined;
  /** Where the key's slot goes once claimed (see {@link takenOverObserver}). */
  endings: DeliveryEndings;
  /** The route is here and the client still connected (called before the log is read). */
  attached?(): void;
}

/**
 * Moves the delivery of a request that runs (or ran) elsewhere to this gateway: a session from the
 * cursor, the request's route moved to this gateway's channel, then the log read from the cursor on
 * and live entries after it. Shared by a resume (`GET …/{id}?stream=true`) and a replay (a POST whose
 * `Idempotency-Key` names a request already admitted). The reply begins once the route moved.
 * @returns the session, and the attach (resolved once the route moved, or the stream failed for it)
 */
export function takeOver(
  deps: Pick<AppDeps, 'sessions' | 'jobs'>,
  options: TakeOverOptions,
): { session: RequestSession; done: Promise<void> } {
  const { sessions, jobs } = deps;
  const { jobId, meta, cursor, last, responder, client } = options;
  // Past its `accepted` (before the cursor), the session learns its worker and attempt from the meta:
  // a worker lost from now on migrates the stream as it would one opened here.
  const session = sessions.open(jobId, meta.deadlineAt, (event) => responder.handle(event), {
    nextSeq: cursor + 1,
    graceMs: meta.graceMs,
    accepted: cursor >= 0,
    // Scheduled by its engine once its log holds anything after its `accepted` (a `scheduled` entry,
    // output, its end); with only the `accepted`, it still waits for a place in the engine.
    scheduled: cursor >= 0 && last !== undefined && last.type !== 'accepted',
    workerId: meta.workerId,
    attempt: meta.attempt,
    owner: options.key?.hash,
    takenOver: true,
  });
  // A client that leaves while the route moves here is answered at once; the session leaves (its
  // work cancelled, or detached with a grace) once the attach is done, so that the detach comes
  // after it (a detach sent before the attach would be undone by it).
  let attached = false;
  client.onLeave(() => {
    if (responder.done) return;
    responder.clientClosed(meta.graceMs > 0);
    if (attached) sessions.clientLeft(session);
  });
  const done = jobs.attach(jobId).then(
    () => {
      attached = true;
      if (client.gone) {
        sessions.clientLeft(session);
        return;
      }
      // The reply starts (a stream's headers) once the route is here: a client that has them may close
      // its older connection, whose leaving no longer stops the work (its gateway's cancel applies only
      // while the request routes there). Begun before the attach, a client that did so at once could
      // see the old connection's cancel win and the answer end `abort`. A failed attach is an HTTP 503.
      responder.begin();
      // Under a key, the delivery holds the request's stream slot (max-streams) and its token
      // reservation, and its tokens count under the key: claimed only by one still open (one that
      // ended meanwhile would never give them back).
      const { key, admission } = options;
      if (key !== undefined && admission !== undefined && !responder.done) {
        options.endings.slot = admission.resumed(key, jobId, meta.deadlineAt, meta.graceMs);
      }
      options.attached?.();
      sessions.repair(session);
    },
    (error: unknown) => {
      // Nothing was taken over: the request stays where it was (detached, or still delivered by its
      // first connection), and so do its key's stream slot and token reservation, which are claimed
      // only once the attach is done (a claim before it kept the slot to the request's deadline, then
      // only for the grace, and left the reservation to a delivery that would never settle it).
      sessions.release(session);
      const failure = new GatewayError('store_unavailable', { message: 'The stream store is unavailable: resume again.', cause: error });
      responder.handle({ type: 'failed', error: failure, detached: true });
    },
  );
  return { session, done };
}
