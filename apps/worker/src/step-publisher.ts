import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { encodeGatewayMessage, type GatewayEntry, type GatewayEntryDraft } from '@sluice/protocol';

/**
 * Collects the entries of one engine step and publishes them as ONE message per gateway channel.
 * The engine delivers all events of a step in one macrotask, so a flush scheduled with setImmediate
 * sees the whole step. Numbers each request's entries 0, 1, 2, ... so the gateway can detect a gap.
 */
export class StepPublisher {
  private readonly nextSeq = new Map<string, number>();
  private pending = new Map<string, GatewayEntry[]>();
  private scheduled = false;
  private flushing: Promise<void> = Promise.resolve();

  constructor(
    private readonly redis: Redis,
    private readonly workerId: string,
    private readonly logger: Logger,
  ) {}

  push(channel: string, draft: GatewayEntryDraft): void {
    const seq = this.nextSeq.get(draft.requestId) ?? 0;
    this.nextSeq.set(draft.requestId, seq + 1);
    const entry = { ...draft, seq } as GatewayEntry;
    const entries = this.pending.get(channel);
    if (entries === undefined) this.pending.set(channel, [entry]);
    else entries.push(entry);
    if (!this.scheduled) {
      this.scheduled = true;
      setImmediate(() => this.flush());
    }
  }

  /** Drops a finished request's counter (its last entry was pushed). */
  forget(requestId: string): void {
    this.nextSeq.delete(requestId);
  }

  /** Resolves when everything pushed so far has been handed to Redis. */
  async drained(): Promise<void> {
    if (this.scheduled) await new Promise<void>((resolve) => setImmediate(resolve));
    await this.flushing;
  }

  private flush(): void {
    this.scheduled = false;
    const batch = this.pending;
    this.pending = new Map();
    if (batch.size === 0) return;
    const pipeline = this.redis.pipeline();
    for (const [channel, entries] of batch) {
      pipeline.publish(channel, encodeGatewayMessage({ workerId: this.workerId, entries }));
    }
    this.flushing = pipeline.exec().then(
      () => undefined,
      (error: unknown) => this.logger.error({ err: error }, 'publishing a step failed'),
    );
  }
}
