import type { Socket } from 'node:net';

/** Told when the socket did not take a write whole (Node buffered the rest: it is congested). */
export interface WriteRefusal {
  refused(socket: Socket): void;
}

/**
 * The stream frames of one turn of the event loop, written to their sockets back to back at its end.
 *
 * A gateway-channel message carries one delta for each of hundreds of streams. Writing each frame as
 * its delta is formatted interleaves as many `write` syscalls (on loopback, each delivers the segment
 * and wakes the reader) with the gateway's own work; made together after the message, the same writes
 * cost ~25 % less kernel time, and the write path 1–4 % less CPU per event in all (two A/B runs,
 * docs/benchmarks.md, stop 40). Order holds per socket: the writes go out in the order queued, and anything that writes
 * to a response another way flushes first ({@link flush}).
 */
export class SocketWriteBurst {
  private sockets: Socket[] = [];
  private chunks: string[] = [];
  private encodings: BufferEncoding[] = [];
  private owners: WriteRefusal[] = [];

  /** Queues `chunk` for `socket`; the burst goes out in a microtask, after the current work. */
  write(socket: Socket, chunk: string, latin1: boolean, owner: WriteRefusal): void {
    if (this.sockets.length === 0) queueMicrotask(() => this.flush());
    this.sockets.push(socket);
    this.chunks.push(chunk);
    this.encodings.push(latin1 ? 'latin1' : 'utf8');
    this.owners.push(owner);
  }

  /** Writes what is queued now (a no-op when nothing is). */
  flush(): void {
    const { sockets, chunks, encodings, owners } = this;
    if (sockets.length === 0) return;
    this.sockets = [];
    this.chunks = [];
    this.encodings = [];
    this.owners = [];
    for (let i = 0; i < sockets.length; i++) {
      const socket = sockets[i]!;
      // Closed since (the client left): its writer was abandoned, nothing reads these bytes.
      if (!socket.writable) continue;
      if (!socket.write(chunks[i]!, encodings[i])) owners[i]!.refused(socket);
    }
  }
}

/** The gateway's one burst: every stream's frames of a turn go out together. */
export const socketWrites = new SocketWriteBurst();
