import type { ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import type { GatewayHooks } from './hooks.js';
import { socketWrites, type WriteRefusal } from './socket-write-burst.js';

/**
 * Headers of every SSE reply (DESIGN.md, wire facts). No `Connection` header: Node sends
 * `keep-alive` for a client that keeps its connection and closes it after the stream for one that
 * asked `Connection: close`; naming `keep-alive` here kept such a connection open until the idle
 * timeout (65 s).
 */
export const SSE_HEADERS = {
  'Content-Type': 'text/event-stream; charset=utf-8',
  'Cache-Control': 'no-cache',
  'X-Accel-Buffering': 'no',
} as const;

const PING = ': ping\n\n';
const DONE = 'data: [DONE]\n\n';
// ASCII: the byte length is the string length.
const PING_BYTES = PING.length;
const DONE_BYTES = DONE.length;

type SseMeter = NonNullable<GatewayHooks['sseWritten']>;
const noMeter: SseMeter = () => {};

/**
 * Writes SSE frames straight to the Node response. Hono's `streamSSE` goes through a web
 * ReadableStream and measured ~0.35× the events/s of a plain `res.write` here, so the stream path
 * bypasses it.
 */
export class SseWriter implements WriteRefusal {
  /** Set by every write; the heartbeat ticker clears it. */
  wroteSinceTick = false;
  /** Last tick that saw a write (heartbeat ticker clock). */
  lastWriteTick = 0;
  /**
   * The socket is not draining: `res.write()` returned false and no `drain` came since. The responder
   * then coalesces deltas instead of writing them (adaptive coalescing).
   */
  congested = false;
  /** When the current congestion began (ms since epoch): the stall clock. */
  congestedSince = 0;
  /** Called on `drain` after a congestion (the responder writes what it coalesced meanwhile). */
  onDrain: (() => void) | undefined;
  /** Called by the ticker when a congestion outlasts the stall timeout. */
  onStall: (() => void) | undefined;
  private ended = false;
  private readonly meter: SseMeter;

  /** @param meter counts frames and bytes per write (metrics); runs on the hot path. */
  constructor(
    readonly res: ServerResponse,
    private readonly heartbeats: HeartbeatTicker,
    meter: SseMeter | undefined = undefined,
  ) {
    this.meter = meter ?? noMeter;
  }

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

  /**
   * Writes whole SSE frames (`data: {json}\n\n`, built by the response format in one piece).
   * @param count how many frames `frames` holds (for the metrics)
   * @param ascii the caller knows `frames` is all ASCII: it goes out as Latin-1, the same bytes, and
   *   neither Node's chunked framing nor the byte counter scans it for its UTF-8 length (per token,
   *   that scan was ~8 % of the gateway's CPU on the write path). Wrong for any other text.
   */
  frames(frames: string, count = 1, ascii = false): void {
    if (this.ended || frames === '') return;
    const bytes = ascii ? frames.length : Buffer.byteLength(frames);
    const socket = this.ownSocket();
    if (socket === undefined) {
      socketWrites.flush();
      if (!(ascii ? this.res.write(frames, 'latin1') : this.res.write(frames))) this.congest(this.res);
    } else {
      // With the other streams' frames of this turn, in one burst (see SocketWriteBurst).
      socketWrites.write(socket, `${bytes.toString(16)}\r\n${frames}\r\n`, ascii, this);
    }
    this.wroteSinceTick = true;
    this.meter('chunk', bytes, count);
  }

  /**
   * The socket, when this response owns it with nothing of its own still buffered and frames its
   * body as HTTP/1.1 chunks: a frame then goes to the socket as one pre-framed chunk, one write.
   * `res.write` makes four (size, CRLF, data, CRLF) into a socket it corks until the next tick, then
   * a writev of the four: ~15 % of a raw writer's CPU per event here (docs/benchmarks.md, stop 20).
   * Anything else (a pipelined response still queued behind another, an HTTP/1.0 client) goes
   * through `res.write`.
   */
  private ownSocket(): Socket | undefined {
    const { res } = this;
    const socket = res.socket;
    return socket !== null && socket.writable && res.chunkedEncoding && res.writableLength === socket.writableLength ? socket : undefined;
  }

  /** Bytes written but not yet handed to the kernel (this response's and its socket's buffers). */
  get buffered(): number {
    return this.res.writableLength;
  }

  ping(): void {
    // Bytes already wait on a congested socket: a ping there keeps nothing alive and only adds to them.
    if (this.ended || this.congested) return;
    socketWrites.flush();
    if (!this.res.write(PING)) this.congest();
    this.meter('heartbeat', PING_BYTES, 1);
  }

  /**
   * Ends the stream normally: optional last frame (the usage chunk), then `[DONE]`.
   * @param idLine `id: <cursor>\n` of the last event (on the usage chunk, else on `[DONE]`)
   */
  done(frame = '', idLine = ''): void {
    if (this.ended) return;
    if (frame === '') {
      this.finish(idLine + DONE);
      this.meter('done', idLine.length + DONE_BYTES, 1);
      return;
    }
    this.finish(idLine + frame + DONE);
    this.meter('chunk', idLine.length + Buffer.byteLength(frame), 1);
    this.meter('done', DONE_BYTES, 1);
  }

  /** Ends the stream with pre-built frames: one error frame, then `[DONE]`. */
  endWith(frames: string): void {
    if (this.ended) return;
    this.finish(frames);
    this.meter('error', Buffer.byteLength(frames) - DONE_BYTES, 1);
    this.meter('done', DONE_BYTES, 1);
  }

  /** Releases the writer without writing (the client is gone). */
  abandon(): void {
    if (this.ended) return;
    this.ended = true;
    this.heartbeats.delete(this);
  }

  /** The burst's write to this response's socket was not taken whole. */
  refused(socket: Socket): void {
    this.congest(socket);
  }

  /** @param stream what refused the write: the response, or its socket written directly (the response then emits no `drain`) */
  private congest(stream: ServerResponse | Socket = this.res): void {
    if (this.congested) return;
    this.congested = true;
    this.congestedSince = Date.now();
    stream.once('drain', () => {
      this.congested = false;
      if (!this.ended) this.onDrain?.();
    });
  }

  private finish(frames: string): void {
    // The frames queued before the end go first.
    socketWrites.flush();
    this.ended = true;
    if (!this.res.destroyed) this.res.end(frames);
    if (this.congested && !this.res.writableFinished) {
      // The end waits behind bytes the client is not reading: the stall timeout still applies, then
      // the socket closes and its buffers go.
      this.onDrain = undefined;
      this.onStall = () => {
        this.heartbeats.delete(this);
        this.res.destroy();
      };
      this.res.once('finish', () => this.heartbeats.delete(this));
      return;
    }
    this.heartbeats.delete(this);
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

  /**
   * @param stallMs a stream whose socket stays congested this long (no `drain`) is given up on
   *   (`SseWriter.onStall`); 0 disables it
   */
  constructor(
    private readonly heartbeatMs: number,
    private readonly stallMs = 0,
  ) {
    const tickMs = Math.max(5, Math.min(1000, Math.floor(heartbeatMs / 5), stallMs > 0 ? Math.floor(stallMs / 5) : Infinity));
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
      if (writer.congested && this.stallMs > 0 && now - writer.congestedSince >= this.stallMs) {
        writer.onStall?.();
        continue;
      }
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
