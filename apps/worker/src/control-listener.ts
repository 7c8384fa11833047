import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { decodeControlMessage, receivedCancelReasonSchema } from '@sluice/protocol';
import type { StepRouter } from './step-router.js';

/**
 * Listens on the control channel: cancels abort the sequences this worker runs, route messages move a
 * request's live entries (a resume on another gateway) or detach them (the client left with a grace).
 * Requests register their AbortController before the worker checks the cancel marker, so a cancel is
 * never missed between the two.
 *
 * Pub/sub is at most once: what was published while the subscriber reconnected is gone. On a
 * reconnect the listener reads back what it may have missed — the running requests' routes from their
 * metas, and their cancel markers (a gateway's cancel sets one, ≤ 30 s, while the request routes to
 * it) — so a lost cancel stops the work as soon as the subscriber is back, not when its gateway next
 * sends it again (every second while the request keeps publishing; a fast model had finished its
 * answer by then).
 */
export class ControlListener {
  private readonly running = new Map<string, AbortController>();
  private subscribedOnce = false;
  private closing = false;

  /**
   * @param redis a command connection (the reconnect's reads)
   * @param markerKey a request's cancel marker key (`RedisNames.cancelMarkerKey`)
   */
  constructor(
    private readonly subscriber: Redis,
    private readonly channel: string,
    private readonly router: StepRouter,
    private readonly logger: Logger,
    private readonly redis: Redis,
    private readonly markerKey: (requestId: string) => string,
  ) {}

  async start(): Promise<void> {
    this.subscriber.on('message', (channel: string, raw: string) => {
      if (channel !== this.channel) return;
      try {
        const message = decodeControlMessage(raw);
        if (message.type === 'route') {
          // The meta, not the message, says where the request goes now: two gateways' route messages
          // (two resumes) can arrive in the other order, and the older one used to win.
          this.router.resyncRoutes([message.requestId]).catch((error: unknown) => {
            this.logger.warn({ err: error, requestId: message.requestId }, 'reading a route failed: applying its message');
            if (message.channel === null) this.router.detach(message.requestId, message.from ?? null);
            else this.router.attach(message.requestId, message.channel);
          });
          return;
        }
        for (const requestId of message.requestIds) {
          const controller = this.running.get(requestId);
          if (controller === undefined) continue;
          const from = message.channel;
          if (from === undefined) {
            this.cancel(requestId, controller, message.reason);
            continue;
          }
          // A gateway's cancel applies only while the request still routes to it (not after a resume
          // elsewhere), as its meta says: this worker's own view may not have heard of the latest move.
          this.router.routeOf(requestId).then(
            (route) => {
              const routed = route === undefined ? this.router.channelOf(requestId) : route;
              if (routed === from) this.cancel(requestId, controller, message.reason);
            },
            (error: unknown) => {
              this.logger.warn({ err: error, requestId }, 'reading a route failed: checking the cancel against this worker’s view');
              if (this.router.channelOf(requestId) === from) this.cancel(requestId, controller, message.reason);
            },
          );
        }
      } catch (error) {
        this.logger.error({ err: error }, 'malformed control message dropped');
      }
    });
    this.subscriber.on('ready', () => {
      // ioredis resubscribes on its own after a reconnect; what was published meanwhile is gone. Lost
      // cancels are read back from the requests' cancel markers (and sent again by their gateways, which
      // see the request still publishing); lost route moves are read back from the requests' metas.
      if (!this.subscribedOnce || this.closing) return;
      this.logger.warn("control subscriber reconnected: reading the running requests' routes and cancel markers again");
      this.router.resyncRoutes().catch((error: unknown) => this.logger.warn({ err: error }, 'reading the routes again failed'));
      this.readMissedCancels().catch((error: unknown) => this.logger.warn({ err: error }, 'reading the cancel markers again failed'));
    });
    await this.subscriber.subscribe(this.channel);
    this.subscribedOnce = true;
  }

  /** Stops the running requests whose cancel marker is set (a cancel this listener may not have heard). */
  private async readMissedCancels(): Promise<void> {
    const requestIds = [...this.running.keys()];
    if (requestIds.length === 0) return;
    // GETs in one pipeline, not one MGET: the markers need not share a hash slot.
    const reads = this.redis.pipeline();
    for (const requestId of requestIds) reads.get(this.markerKey(requestId));
    const replies = (await reads.exec()) ?? [];
    requestIds.forEach((requestId, i) => {
      const [error, marker] = replies[i] ?? [];
      const controller = this.running.get(requestId);
      if ((error !== null && error !== undefined) || typeof marker !== 'string' || controller === undefined) return;
      // The marker holds the cancel's reason.
      this.logger.info({ requestId }, 'a cancel missed while reconnecting: stopping the request');
      this.cancel(requestId, controller, receivedCancelReasonSchema.parse(marker));
    });
  }

  private cancel(requestId: string, controller: AbortController, reason: string): void {
    this.logger.debug({ requestId, reason }, 'cancel');
    controller.abort(reason);
  }

  register(requestId: string, controller: AbortController): void {
    this.running.set(requestId, controller);
  }

  unregister(requestId: string): void {
    this.running.delete(requestId);
  }

  /** Aborts every registered request (drain timeout). */
  abortAll(reason: string): void {
    for (const controller of this.running.values()) controller.abort(reason);
  }

  async close(): Promise<void> {
    this.closing = true;
    await this.subscriber.quit();
  }
}
