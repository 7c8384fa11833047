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

  /** `raw` decoded, or undefined (logged) when it is malformed. */
  private decoded<T>(raw: string, decode: (raw: string) => T, what: string): T | undefined {
    try {
      return decode(raw);
    } catch (error) {
      this.logger.error({ err: error }, `malformed ${what} dropped`);
      return undefined;
    }
  }

  async start(): Promise<void> {
    this.subscriber.on('message', (channel: string, raw: string) => {
      if (channel === this.channel) {
        const message = this.decoded(raw, decodeGatewayMessage, 'gateway message');
        if (message !== undefined) this.handlers.message(message);
      } else if (channel === this.gatewaysChannel) {
        const message = this.decoded(raw, decodeGatewayBroadcast, 'message to all gateways');
        if (message !== undefined) this.handlers.broadcast(message);
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
