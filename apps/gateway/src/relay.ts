import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { decodeGatewayMessage, type GatewayMessage } from '@sluice/protocol';

/**
 * The gateway's one subscription: one connection, one channel for the whole instance. Workers publish
 * one message per engine step carrying the entries of all this gateway's requests; the relay decodes it
 * and hands it on. A reconnect means messages may have been lost (pub/sub is at-most-once): the relay
 * reports it, and the caller repairs the open streams from their token logs.
 */
export class Relay {
  private subscribedOnce = false;
  private closing = false;

  constructor(
    private readonly subscriber: Redis,
    readonly channel: string,
    private readonly onMessage: (message: GatewayMessage) => void,
    private readonly onMessagesLost: () => void,
    private readonly logger: Logger,
  ) {}

  async start(): Promise<void> {
    this.subscriber.on('message', (channel: string, raw: string) => {
      if (channel !== this.channel) return;
      let message: GatewayMessage;
      try {
        message = decodeGatewayMessage(raw);
      } catch (error) {
        this.logger.error({ err: error }, 'malformed gateway message dropped');
        return;
      }
      this.onMessage(message);
    });
    this.subscriber.on('ready', () => {
      // ioredis resubscribes on its own after a reconnect; what was published meanwhile is gone.
      if (this.subscribedOnce && !this.closing) {
        this.logger.warn('subscriber reconnected: repairing open streams from their logs');
        this.onMessagesLost();
      }
    });
    await this.subscriber.subscribe(this.channel);
    this.subscribedOnce = true;
  }

  async close(): Promise<void> {
    this.closing = true;
    await this.subscriber.quit();
  }
}
