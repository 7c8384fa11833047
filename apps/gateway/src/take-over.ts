import type { GatewayEntry, RequestMeta } from '@sluice/protocol';
import type { AppDeps } from './app.js';
import type { ClientPresence } from './client-presence.js';
import { GatewayError } from './errors.js';
import type { RequestSession, SessionEvent } from './request-session.js';

/** What a taken-over delivery writes to: a resumed stream, or a replayed request's stream or JSON reply. */
export interface TakingResponder {
  readonly done: boolean;
  begin(): void;
  handle(event: SessionEvent): void;
  /** @param detached the work goes on without this connection (a resume grace) */
  clientClosed(detached: boolean): void;
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
  /** The API key that made the request (see resume.ts ownedByCaller). */
  owner: string | undefined;
  /**
   * The route is here and the client still connected (called before the log is read): the place to
   * claim the key's stream slot and token reservation, if the responder is still open.
   */
  attached(): void;
}

/**
 * Moves the delivery of a request that runs (or ran) elsewhere to this gateway: a session from the
 * cursor, the request's route moved to this gateway's channel, then the log read from the cursor on
 * and live entries after it. Shared by a resume (`GET …/{id}?stream=true`) and a replay (a POST whose
 * `Idempotency-Key` names a request already admitted).
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
    owner: options.owner,
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
  responder.begin();
  const done = jobs.attach(jobId).then(
    () => {
      attached = true;
      if (client.gone) {
        sessions.clientLeft(session);
        return;
      }
      options.attached();
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
