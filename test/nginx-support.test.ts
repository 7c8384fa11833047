import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { readFile } from 'node:fs/promises';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { SLUICE_PROXY_CONF, checkNginxConfig, startNginx, type NginxServer } from './support/nginx.js';

/** A node:http server on a free loopback port. */
async function listen(handler: (req: IncomingMessage, res: ServerResponse) => void): Promise<{ server: Server; port: number }> {
  const server = createServer(handler);
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return { server, port: (server.address() as AddressInfo).port };
}

/** Resolves with `promise`, or rejects with `message` after `ms`. */
function within<T>(promise: Promise<T>, ms: number, message: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const expired = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(message)), ms);
  });
  return Promise.race([promise, expired]).finally(() => clearTimeout(timer));
}

/** Reads SSE `data:` payloads from a fetch body, one callback per complete event. */
async function readEvents(body: ReadableStream<Uint8Array>, onEvent: (data: string) => void): Promise<void> {
  const decoder = new TextDecoder();
  let buffered = '';
  for await (const chunk of body) {
    buffered += decoder.decode(chunk, { stream: true });
    let end: number;
    while ((end = buffered.indexOf('\n\n')) !== -1) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      const data = event.split('\n').find((line) => line.startsWith('data: '));
      if (data !== undefined) onEvent(data.slice('data: '.length));
    }
  }
}

describe('startNginx', () => {
  const cleanups: Array<() => Promise<void>> = [];
  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  });
  async function start(upstreamPorts: number[]): Promise<NginxServer> {
    const nginx = await startNginx({ upstreamPorts });
    cleanups.push(() => nginx.close());
    return nginx;
  }
  async function upstream(handler: (req: IncomingMessage, res: ServerResponse) => void): Promise<number> {
    const { server, port } = await listen(handler);
    cleanups.push(
      () =>
        new Promise<void>((resolve) => {
          server.closeAllConnections();
          server.close(() => resolve());
        }),
    );
    return port;
  }

  it('delivers each SSE event before the stream ends (no buffering)', async () => {
    // The server writes event i, then waits until the client has read it before writing i + 1: if
    // nginx held events back, the client would never see the first one and the test would time out.
    const events = 5;
    const seen: Array<() => void> = [];
    const seenBy = Array.from({ length: events }, (_, i) => new Promise<void>((resolve) => (seen[i] = resolve)));
    let serverDone = false;
    const port = await upstream((req, res) => {
      // No X-Accel-Buffering header: the proxy config alone must turn buffering off.
      res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache' });
      void (async () => {
        for (let i = 0; i < events; i++) {
          res.write(`data: ${JSON.stringify({ i })}\n\n`);
          await within(seenBy[i]!, 5000, `event ${i} did not reach the client while the stream was open`).catch(() => {});
        }
        serverDone = true;
        res.end('data: [DONE]\n\n');
      })();
    });
    const nginx = await start([port]);

    const response = await fetch(`${nginx.url}/v1/chat/completions`, { method: 'POST', body: '{}' });
    expect(response.status).toBe(200);
    expect(response.headers.get('content-type')).toBe('text/event-stream');
    const received: string[] = [];
    let endedEarly = false;
    await readEvents(response.body!, (data) => {
      received.push(data);
      if (data === '[DONE]') return;
      if (serverDone) endedEarly = true;
      seen[(JSON.parse(data) as { i: number }).i]?.();
    });
    expect(received).toEqual([...Array.from({ length: events }, (_, i) => JSON.stringify({ i })), '[DONE]']);
    expect(endedEarly).toBe(false);
  });

  it('passes the client X-Request-Id to the upstream, or makes one', async () => {
    const ids: Array<string | undefined> = [];
    const port = await upstream((req, res) => {
      ids.push(req.headers['x-request-id'] as string | undefined);
      res.end('ok');
    });
    const nginx = await start([port]);
    await (await fetch(nginx.url, { headers: { 'X-Request-Id': 'req-abc-123' } })).text();
    await (await fetch(nginx.url)).text();
    expect(ids[0]).toBe('req-abc-123');
    expect(ids[1]).toMatch(/^[0-9a-f]{32}$/);
  });

  it('balances over every upstream and keeps serving when one is gone', async () => {
    const served = [0, 0];
    const ports = [
      await upstream((_, res) => {
        served[0]! += 1;
        res.end('a');
      }),
      await upstream((_, res) => {
        served[1]! += 1;
        res.end('b');
      }),
    ];
    const nginx = await start(ports);
    for (let i = 0; i < 10; i++) await (await fetch(nginx.url)).text();
    expect(served[0]).toBeGreaterThan(0);
    expect(served[1]).toBeGreaterThan(0);

    // Close the first upstream: requests fail over to the second.
    await cleanups.splice(0, 1)[0]!();
    const bodies: string[] = [];
    for (let i = 0; i < 6; i++) {
      const response = await fetch(nginx.url);
      expect(response.status).toBe(200);
      bodies.push(await response.text());
    }
    expect(bodies.every((body) => body === 'b')).toBe(true);
  });

  it('closes the upstream connection when the client goes away mid-stream', async () => {
    let upstreamClosed!: () => void;
    const closed = new Promise<void>((resolve) => (upstreamClosed = resolve));
    let firstWritten!: () => void;
    const written = new Promise<void>((resolve) => (firstWritten = resolve));
    const port = await upstream((_, res) => {
      res.writeHead(200, { 'Content-Type': 'text/event-stream' });
      res.write('data: 1\n\n');
      firstWritten();
      res.on('close', () => upstreamClosed());
    });
    const nginx = await start([port]);
    const abort = new AbortController();
    const response = await fetch(nginx.url, { signal: abort.signal });
    const reader = response.body!.getReader();
    await reader.read();
    await written;
    abort.abort();
    await within(closed, 5000, 'the upstream connection stayed open after the client left');
  });

  it('stops nginx and removes its files on close', async () => {
    const port = await upstream((_, res) => res.end('ok'));
    const nginx = await startNginx({ upstreamPorts: [port] });
    expect(await nginx.errorLog()).not.toMatch(/\[emerg\]/);
    await nginx.close();
    await expect(fetch(nginx.url)).rejects.toThrow();
    await expect(import('node:fs/promises').then((fs) => fs.stat(nginx.dir))).rejects.toThrow();
  });

  it('fails with the error log when the config cannot work', async () => {
    // Its listen port is already taken by another server.
    const { server, port } = await listen((_, res) => res.end());
    cleanups.push(() => new Promise<void>((resolve) => server.close(() => resolve())));
    await expect(startNginx({ upstreamPorts: [port], port, startTimeoutMs: 5000 })).rejects.toThrow(/nginx did not start/);
  });
});

describe('deploy/nginx/nginx.conf', () => {
  it('passes nginx -t with the shared proxy settings', async () => {
    const deployed = await readFile(new URL('../deploy/nginx/nginx.conf', import.meta.url), 'utf8');
    // Compose resolves the gateway names and mounts the proxy settings; stand in for both here.
    const local = deployed
      .replace(/gateway-\d+:8080/g, '127.0.0.1:8080')
      .replace('include /etc/nginx/sluice-proxy.conf;', `include ${SLUICE_PROXY_CONF};`);
    expect(local).not.toBe(deployed);
    expect(await checkNginxConfig(local)).toMatch(/syntax is ok/);
  });

  it('rejects a broken config', async () => {
    await expect(checkNginxConfig('events {}\nhttp {\n  proxy_buffering maybe;\n}\n')).rejects.toThrow(/nginx -t failed/);
  });
});
