import { createServer, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { HeartbeatTicker, SseWriter } from '../src/sse-writer.js';

let server: Server | undefined;
const heartbeats = new HeartbeatTicker(60_000);

afterEach(async () => {
  server?.closeAllConnections();
  await new Promise((resolve) => server?.close(resolve));
  server = undefined;
});

/** A real server whose first response is handed to the test, and a fetch reading its body. */
async function oneStream(): Promise<{ res: ServerResponse; body: Promise<string> }> {
  let handed!: (res: ServerResponse) => void;
  const response = new Promise<ServerResponse>((resolve) => (handed = resolve));
  server = createServer((_req, res) => handed(res));
  await new Promise<void>((resolve) => server!.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  const body = fetch(`http://127.0.0.1:${port}/`).then((reply) => reply.text());
  return { res: await response, body };
}

describe('SseWriter', () => {
  it('writes each frame to the socket it owns as one pre-framed HTTP chunk, after the turn that made it', async () => {
    const { res, body } = await oneStream();
    const writer = new SseWriter(res, heartbeats);
    writer.start();
    const write = vi.spyOn(res.socket!, 'write');
    writer.frames('data: {"a":1}\n\n', 1, true); // 15 bytes
    writer.frames('data: {"b":"é"}\n\n'); // 17 characters, 18 bytes
    expect(write).not.toHaveBeenCalled();
    await new Promise(setImmediate);
    expect(write.mock.calls.map(([chunk, encoding]) => [chunk, encoding])).toEqual([
      ['f\r\ndata: {"a":1}\n\n\r\n', 'latin1'],
      ['12\r\ndata: {"b":"é"}\n\n\r\n', 'utf8'],
    ]);
    writer.done();
    expect(await body).toBe('data: {"a":1}\n\ndata: {"b":"é"}\n\ndata: [DONE]\n\n');
  });

  it('ends a stream after the frames queued before its end, in the same turn', async () => {
    const { res, body } = await oneStream();
    const writer = new SseWriter(res, heartbeats);
    writer.start();
    writer.frames('data: 1\n\n', 1, true);
    writer.frames('data: 2\n\n', 1, true);
    writer.done('data: 3\n\n');
    expect(await body).toBe('data: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n');
  });

  it('is congested once its socket did not take a queued frame whole, until the socket drains', async () => {
    const { res, body } = await oneStream();
    const writer = new SseWriter(res, heartbeats);
    writer.start();
    const socket = res.socket!;
    const write = socket.write.bind(socket) as (chunk: string, encoding: BufferEncoding) => boolean;
    vi.spyOn(socket, 'write').mockImplementationOnce((chunk: string | Uint8Array, encoding?: unknown) => {
      write(chunk as string, encoding as BufferEncoding);
      return false;
    });
    writer.frames('data: 1\n\n', 1, true);
    expect(writer.congested).toBe(false);
    await new Promise(setImmediate);
    expect(writer.congested).toBe(true);
    socket.emit('drain');
    expect(writer.congested).toBe(false);
    writer.done();
    expect(await body).toBe('data: 1\n\ndata: [DONE]\n\n');
  });
});
