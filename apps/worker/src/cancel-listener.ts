import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { decodeCancelMessage } from '@sluice/protocol';

/**
 * Listens on the cancel channel and aborts the sequences this worker runs. Requests register their
 * AbortController before the worker checks the cancel marker, so a cancel is never missed between the
 * two.
 */
export class CancelListener {
  private readonly running = new Map<string, AbortController>();

  constructor(
    private readonly subscriber: Redis,
    private readonly channel: string,
    private readonly logger: Logger,
  ) {}

  async start(): Promise<void> {
    this.subscriber.on('message', (channel: string, raw: string) => {
      if (channel !== this.channel) return;
      try {
        const message = decodeCancelMessage(raw);
        for (const requestId of message.requestIds) {
          const controller = this.running.get(requestId);
          if (controller === undefined) continue;
          this.logger.debug({ requestId, reason: message.reason }, 'cancel');
          controller.abort(message.reason);
        }
      } catch (error) {
        this.logger.error({ err: error }, 'malformed cancel message dropped');
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
