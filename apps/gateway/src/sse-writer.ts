import type { ServerResponse } from 'node:http';

/** Headers of every SSE reply (DESIGN.md, wire facts). */
export const SSE_HEADERS = {
  'Content-Type': 'text/event-stream; charset=utf-8',
  'Cache-Control': 'no-cache',
  Connection: 'keep-alive',
  'X-Accel-Buffering': 'no',
} as const;

const PING = ': ping\n\n';
const DONE = 'data: [DONE]\n\n';

/**
 * Writes SSE frames straight to the Node response. Hono's `streamSSE` goes through a web
 * ReadableStream and measured ~0.35× the events/s of a plain `res.write` here, so the stream path
 * bypasses it.
 */
export class SseWriter {
  /** Set by every write; the heartbeat ticker clears it. */
  wroteSinceTick = false;
  /** Last tick that saw a write (heartbeat ticker clock). */
  lastWriteTick = 0;
  private ended = false;

  constructor(
    readonly res: ServerResponse,
    private readonly heartbeats: HeartbeatTicker,
  ) {}

  get open(): boolean {
    return !this.ended && !this.res.destroyed;
  }

  /** Sends the 200 and the SSE headers now, so the client sees the stream start. */
  start(extraHeaders: Record<string, string> = {}): void {
    this.res.writeHead(200, { ...SSE_HEADERS, ...extraHeaders });
    this.res.flushHeaders();
    this.lastWriteTick = this.heartbeats.now;
    this.heartbeats.add(this);
  }

  /** Writes whole SSE frames (`data: {json}\n\n`, built by the response format in one piece). */
  frames(frames: string): void {
    if (this.ended || frames === '') return;
    this.res.write(frames);
    this.wroteSinceTick = true;
  }

  ping(): void {
    if (this.ended) return;
    this.res.write(PING);
  }

  /** Ends the stream normally: optional last frames, then `[DONE]`. */
  done(frames = ''): void {
    if (this.ended) return;
    this.finish(frames + DONE);
  }

  /** Ends the stream with pre-built frames (error frame + `[DONE]`). */
  endWith(frames: string): void {
    if (this.ended) return;
    this.finish(frames);
  }

  /** Releases the writer without writing (the client is gone). */
  abandon(): void {
    if (this.ended) return;
    this.ended = true;
    this.heartbeats.delete(this);
  }

  private finish(frames: string): void {
    this.ended = true;
    this.heartbeats.delete(this);
    if (!this.res.destroyed) this.res.end(frames);
  }
}

/**
 * One timer for the heartbeats of all open streams: a `: ping` goes to every stream that wrote
 * nothing for `heartbeatMs` (± one tick), instead of a timer re-armed per stream per event.
 */
export class HeartbeatTicker {
  now = Date.now();
  private readonly writers = new Set<SseWriter>();
  private readonly timer: NodeJS.Timeout;

  constructor(private readonly heartbeatMs: number) {
    const tickMs = Math.max(5, Math.min(1000, Math.floor(heartbeatMs / 5)));
    this.timer = setInterval(() => this.tick(), tickMs);
    this.timer.unref();
  }

  get size(): number {
    return this.writers.size;
  }

  add(writer: SseWriter): void {
    this.writers.add(writer);
  }

  delete(writer: SseWriter): void {
    this.writers.delete(writer);
  }

  close(): void {
    clearInterval(this.timer);
    this.writers.clear();
  }

  private tick(): void {
    const now = (this.now = Date.now());
    for (const writer of this.writers) {
      if (writer.wroteSinceTick) {
        writer.wroteSinceTick = false;
        writer.lastWriteTick = now;
      } else if (now - writer.lastWriteTick >= this.heartbeatMs) {
        writer.ping();
        writer.lastWriteTick = now;
      }
    }
  }
}
