import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { decodeGatewayBroadcast, decodeGatewayMessage, type GatewayBroadcast, type GatewayMessage } from '@sluice/protocol';

/** What the relay hands on. */
export interface RelayHandlers {
  /** A message on this gateway's channel (workers' entries). */
  message(message: GatewayMessage): void;
  /** A message on the gateways' channel, sent to all of them (a revoked API key). */
  broadcast(message: GatewayBroadcast): void;
  /** The subscriber reconnected: whatever was published meanwhile on either channel is gone. */
  messagesLost(): void;
}

/**
 * The gateway's one subscription: one connection, one channel for the whole instance (plus the
 * gateways' channel, which carries the rare news for all of them). Workers publish one message per
 * engine step carrying the entries of all this gateway's requests; the relay decodes it and hands it
 * on. A reconnect means messages may have been lost (pub/sub is at-most-once): the relay reports it,
 * and the caller repairs the open streams from their token logs.
 */
export class Relay {
  private subscribedOnce = false;
  private closing = false;

  constructor(
    private readonly subscriber: Redis,
    readonly channel: string,
    /** The channel every gateway subscribes to. */
    readonly gatewaysChannel: string,
    private readonly handlers: RelayHandlers,
    private readonly logger: Logger,
  ) {}

  async start(): Promise<void> {
    this.subscriber.on('message', (channel: string, raw: string) => {
      if (channel === this.channel) {
        let message: GatewayMessage;
        try {
          message = decodeGatewayMessage(raw);
        } catch (error) {
          this.logger.error({ err: error }, 'malformed gateway message dropped');
          return;
        }
        this.handlers.message(message);
      } else if (channel === this.gatewaysChannel) {
        let message: GatewayBroadcast;
        try {
          message = decodeGatewayBroadcast(raw);
        } catch (error) {
          this.logger.error({ err: error }, 'malformed message to all gateways dropped');
          return;
        }
        this.handlers.broadcast(message);
      }
    });
    this.subscriber.on('ready', () => {
      // ioredis resubscribes on its own after a reconnect; what was published meanwhile is gone.
      if (this.subscribedOnce && !this.closing) {
        this.logger.warn('subscriber reconnected: repairing open streams from their logs');
        this.handlers.messagesLost();
      }
    });
    await this.subscriber.subscribe(this.channel, this.gatewaysChannel);
    this.subscribedOnce = true;
  }

  async close(): Promise<void> {
    this.closing = true;
    await this.subscriber.quit();
  }
}
