import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { decodeControlMessage } from '@sluice/protocol';
import type { StepRouter } from './step-router.js';

/**
 * Listens on the control channel: cancels abort the sequences this worker runs, route messages move a
 * request's live entries (a resume on another gateway) or detach them (the client left with a grace).
 * Requests register their AbortController before the worker checks the cancel marker, so a cancel is
 * never missed between the two.
 */
export class ControlListener {
  private readonly running = new Map<string, AbortController>();

  constructor(
    private readonly subscriber: Redis,
    private readonly channel: string,
    private readonly router: StepRouter,
    private readonly logger: Logger,
  ) {}

  async start(): Promise<void> {
    this.subscriber.on('message', (channel: string, raw: string) => {
      if (channel !== this.channel) return;
      try {
        const message = decodeControlMessage(raw);
        if (message.type === 'route') {
          if (message.channel === null) this.router.detach(message.requestId, message.from ?? null);
          else this.router.attach(message.requestId, message.channel);
          return;
        }
        for (const requestId of message.requestIds) {
          const controller = this.running.get(requestId);
          if (controller === undefined) continue;
          // A gateway's cancel applies only while the request still routes to it (not after a resume elsewhere).
          if (message.channel !== undefined && this.router.channelOf(requestId) !== message.channel) continue;
          this.logger.debug({ requestId, reason: message.reason }, 'cancel');
          controller.abort(message.reason);
        }
      } catch (error) {
        this.logger.error({ err: error }, 'malformed control message dropped');
      }
    });
    await this.subscriber.subscribe(this.channel);
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
    await this.subscriber.quit();
  }
}
