import { connect, type Socket } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { closeAppHarnesses, startAppHarness as start, type AppHarness } from './support/app-harness.js';

afterEach(closeAppHarnesses);

const DELTA = 'x'.repeat(1000);

/** A raw HTTP client that sends a streaming request and reads only when told to. */
function rawClient(h: AppHarness): { socket: Socket; received: () => string; closed: Promise<void> } {
  const { port } = new URL(h.url);
  const socket = connect(Number(port), '127.0.0.1');
  const body = JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true });
  socket.write(
    `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n${body}`,
  );
  let text = '';
  socket.on('data', (chunk: Buffer) => (text += chunk.toString('utf8')));
  socket.on('error', () => undefined);
  const closed = new Promise<void>((resolve) => socket.on('close', () => resolve()));
  return { socket, received: () => text, closed };
}

/** The content of every chat chunk in a raw (chunked) HTTP reply, in order. */
function contents(raw: string): string[] {
  return [...raw.matchAll(/data: (\{.*?\})\n\n/g)]
    .map((m) => JSON.parse(m[1]!) as { choices?: Array<{ delta?: { content?: string } }> })
    .map((chunk) => chunk.choices?.[0]?.delta?.content ?? '')
    .filter((content) => content !== '');
}

/** Sends `count` deltas, a macrotask apart in batches (as worker steps arrive). */
async function sendDeltas(h: AppHarness, count: number, from = 1): Promise<void> {
  for (let i = 0; i < count; i++) {
    h.send([{ seq: from + i, type: 'text-delta', index: 0, text: DELTA, tokens: 1 }]);
    if (i % 50 === 49) await new Promise((resolve) => setImmediate(resolve));
  }
}

describe('backpressure: a client that does not read', () => {
  it('ends the stream at the buffer bound, cancels its work and counts it as slow_client', async () => {
    const h = await start({ HEADERS_WAIT_MS: '0', MAX_STREAM_BUFFER_BYTES: '65536', CLIENT_STALL_TIMEOUT_MS: '0' });
    const job = h.nextJob();
    const client = rawClient(h);
    client.socket.pause();
    await job;
    h.send([{ seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 2 }]);
    // Far more than the kernel's socket buffers hold: the writer must see the socket congested.
    await sendDeltas(h, 20_000);
    await expect.poll(() => h.cancels.length, { timeout: 10_000 }).toBe(1);
    expect(h.cancels[0]).toMatchObject({ reason: 'client_closed', wasQueued: false });
    expect(await h.value('sluice_gateway_slow_clients_total', { cause: 'buffer' })).toBe(1);
    expect(await h.value('sluice_gateway_request_outcomes_total', { outcome: 'slow_client' })).toBe(1);
    client.socket.destroy();
  });

  it('ends a stream whose socket stays congested past CLIENT_STALL_TIMEOUT_MS', async () => {
    const h = await start({ HEADERS_WAIT_MS: '0', MAX_STREAM_BUFFER_BYTES: '0', CLIENT_STALL_TIMEOUT_MS: '300' });
    const job = h.nextJob();
    const client = rawClient(h);
    client.socket.pause();
    await job;
    h.send([{ seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 2 }]);
    await sendDeltas(h, 20_000);
    await expect.poll(() => h.cancels.length, { timeout: 10_000 }).toBe(1);
    expect(await h.value('sluice_gateway_slow_clients_total', { cause: 'stall' })).toBe(1);
    client.socket.destroy();
  });

  it('gives a slow reader fewer, larger chunks and the whole text', async () => {
    const h = await start({ HEADERS_WAIT_MS: '0', MAX_STREAM_BUFFER_BYTES: '0', CLIENT_STALL_TIMEOUT_MS: '0' });
    const job = h.nextJob();
    const client = rawClient(h);
    client.socket.pause();
    await job;
    const deltas = 10_000;
    h.send([{ seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 2 }]);
    await sendDeltas(h, deltas);
    h.send([
      { seq: deltas + 1, type: 'text-end', index: 0, finishReason: 'length' },
      { seq: deltas + 2, type: 'finish', usage: { promptTokens: 2, completionTokens: deltas } },
    ]);
    // Reads a little at a time, like a client on a slow link.
    const reader = setInterval(() => {
      client.socket.resume();
      setTimeout(() => client.socket.pause(), 2);
    }, 20);
    await expect.poll(() => client.received().includes('data: [DONE]'), { timeout: 60_000, interval: 50 }).toBe(true);
    clearInterval(reader);
    const chunks = contents(client.received());
    expect(chunks.join('')).toBe(DELTA.repeat(deltas));
    expect(chunks.length).toBeLessThan(deltas / 2);
    expect(h.cancels).toEqual([]);
    expect(await h.value('sluice_gateway_request_outcomes_total', { outcome: 'length' })).toBe(1);
    client.socket.destroy();
  });
});
