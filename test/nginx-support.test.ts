import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { readFile } from 'node:fs/promises';
import type { AddressInfo } from 'node:net';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { SLUICE_PROXY_CONF, checkNginxConfig, startNginx, type NginxServer } from './support/nginx.js';
import { waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

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

  it('passes a POST an upstream refuses with 503 to the next one', async () => {
    const refused: string[] = [];
    const ports = [
      await upstream((req, res) => {
        req.resume();
        refused.push(req.method ?? '');
        res.writeHead(503, { 'Content-Type': 'application/json', 'Retry-After': '1' });
        res.end('{"error":{"code":"shutting_down"}}');
      }),
      await upstream((req, res) => {
        let body = '';
        req.setEncoding('utf8').on('data', (chunk: string) => (body += chunk));
        req.on('end', () => res.end(`b:${body}`));
      }),
    ];
    const nginx = await start(ports);
    for (let i = 0; i < 6; i++) {
      const response = await fetch(nginx.url, { method: 'POST', body: `{"i":${i}}` });
      // The body is sent again, whole, to the next upstream.
      expect([response.status, await response.text()]).toEqual([200, `b:{"i":${i}}`]);
    }
    expect(refused.length).toBeGreaterThan(0);
    expect(refused.every((method) => method === 'POST')).toBe(true);
  });

  it('answers an OpenAI-style 503, never its own 502 page, when every upstream refuses', async () => {
    // Every refused try marks its upstream failed (max_fails): soon nginx has none left to ask.
    const refuse = (_: IncomingMessage, res: ServerResponse) => {
      res.writeHead(503, { 'Content-Type': 'application/json', 'Retry-After': '1' });
      res.end('{"error":{"message":"No worker is available.","type":"server_error","param":null,"code":"no_workers"}}');
    };
    const nginx = await start([await upstream(refuse), await upstream(refuse)]);
    const codes = new Set<string>();
    for (let i = 0; i < 6; i++) {
      const response = await fetch(nginx.url, { method: 'POST', body: '{}', headers: { 'X-Request-Id': `refused-${i}` } });
      expect(response.status).toBe(503);
      expect(response.headers.get('retry-after')).toBe('1');
      expect(response.headers.get('content-type')).toBe('application/json');
      const body = (await response.json()) as { error: { code: string; type: string } };
      expect(body.error.type).toBe('server_error');
      codes.add(body.error.code);
      // nginx's own answer carries the request's id, like a gateway's.
      if (body.error.code === 'no_gateway_available') expect(response.headers.get('x-request-id')).toBe(`refused-${i}`);
    }
    // The first from an upstream; then nginx's own, while it has none left to ask.
    expect(codes).toEqual(new Set(['no_workers', 'no_gateway_available']));
  });

  it("passes an upstream's own 502 on unchanged", async () => {
    const port = await upstream((_, res) => {
      res.writeHead(502, { 'Content-Type': 'application/json' });
      res.end('{"error":{"code":"worker_lost"}}');
    });
    const nginx = await start([port]);
    const response = await fetch(nginx.url, { method: 'POST', body: '{}' });
    expect([response.status, await response.text()]).toEqual([502, '{"error":{"code":"worker_lost"}}']);
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

/**
 * A gateway stopped (SIGTERM) behind nginx: while it drains its open streams it refuses every new
 * request with 503 `shutting_down`, and nginx, with no active health checks, kept sending it new ones
 * (least_conn prefers it as its streams end): 6 of 8 POSTs got the 503. nginx now retries a 503 on the
 * other gateway, POSTs included. Real redis-server, two gateways, one worker frozen (SIGSTOP) so that
 * every stream stays open for as long as the test needs, whatever the machine's speed.
 */
describe('a draining gateway behind nginx', () => {
  const STREAMS = 4;
  const POSTS = 8;
  let cluster: Cluster;
  let worker: WorkerProcess;
  let draining: GatewayProcess;
  let other: GatewayProcess;
  let nginx: NginxServer;
  /**
   * The open streams. Their responses are held too: undici cancels the body of a Response that is
   * garbage collected, which closed a stream mid-test (the draining gateway, its last stream gone,
   * exited before the test looked).
   */
  const open: Array<{ controller: AbortController; response: Response }> = [];

  /** A streaming chat request: its 200 comes at once (HEADERS_WAIT_MS=0), its answer never (the worker is frozen). */
  const stream = (url: string, signal: AbortSignal, requestId?: string) =>
    fetch(`${url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', ...(requestId === undefined ? {} : { 'X-Request-Id': requestId }) },
      body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'Hello' }], max_tokens: 8, stream: true }),
      signal,
    });
  const activeStreams = async (gateway: GatewayProcess) =>
    (await scrapePrometheus(`${gateway.url}/metrics`)).value('sluice_gateway_active_streams');

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the frozen worker must not look lost (every request would be a 503 no_workers).
    worker = await cluster.worker({ WORKER_TTL_MS: '60000' });
    // Queued streams outlast the test; the draining one is still draining when it ends.
    const env = { QUEUE_TIMEOUT_MS: '120000', DRAIN_TIMEOUT_MS: '120000' };
    [draining, other] = await Promise.all([cluster.gateway(env), cluster.gateway(env)]);
    nginx = await startNginx({ upstreamPorts: [draining, other].map((g) => Number(new URL(g.url).port)) });
  }, 120_000);

  afterAll(async () => {
    for (const { controller } of open) controller.abort();
    worker?.process.signal('SIGCONT');
    await nginx?.close();
    await cluster?.stop();
  });

  it('sends the requests it refuses to the other gateway, POSTs included', async () => {
    worker.process.signal('SIGSTOP');
    // Streams open on both gateways, through nginx: the one that stops has work to drain.
    for (let i = 0; i < STREAMS; i++) {
      const controller = new AbortController();
      const response = await stream(nginx.url, controller.signal);
      open.push({ controller, response });
      expect(response.status).toBe(200);
    }
    await waitFor('streams open on both gateways', async () =>
      (await activeStreams(draining)) >= 1 && (await activeStreams(other)) >= 1 ? true : undefined,
    );

    draining.process.signal('SIGTERM');
    await waitFor('the stopped gateway draining', async () => {
      const controller = new AbortController();
      const response = await stream(draining.url, controller.signal);
      // Accepted before the signal landed: a stream that would never end.
      if (response.status === 200) return void controller.abort();
      return response.status === 503 && (await response.text()).includes('shutting_down') ? true : undefined;
    });
    expect(await activeStreams(draining)).toBeGreaterThanOrEqual(1);

    // Each new stream stays open: least_conn then prefers the draining gateway, which refuses it.
    const ids = Array.from({ length: POSTS }, (_, i) => `drain-${i}`);
    const statuses: number[] = [];
    for (const id of ids) {
      const controller = new AbortController();
      const response = await stream(nginx.url, controller.signal, id);
      open.push({ controller, response });
      statuses.push(response.status);
      if (response.status !== 200) await response.text();
    }
    expect(statuses).toEqual(ids.map(() => 200));
    expect(draining.process.child.exitCode).toBe(null);

    // nginx logs a request once it ends: every one was served by the other gateway, some after the
    // draining one refused it.
    for (const { controller } of open.splice(STREAMS)) controller.abort();
    const drainingAddress = new URL(draining.url).host;
    const otherAddress = new URL(other.url).host;
    const tries = await waitFor('every POST in the access log', async () => {
      // Each request's tries: the gateways asked, in order, and what each answered.
      const logged = new Map<string, { upstreams: string[]; statuses: string[] }>();
      for (const line of (await nginx.accessLog()).split('\n')) {
        const match = / upstream=(.*) upstream_status=(.*) request_id=(\S+)$/.exec(line);
        if (match !== null) logged.set(match[3]!, { upstreams: match[1]!.split(', '), statuses: match[2]!.split(', ') });
      }
      const found = ids.flatMap((id) => logged.get(id) ?? []);
      return found.length === ids.length ? found : undefined;
    });
    for (const { upstreams, statuses: upstreamStatuses } of tries) {
      expect(upstreams.at(-1)).toBe(otherAddress);
      expect(upstreamStatuses.at(-1)).toBe('200');
    }
    const retried = tries.filter((t) => t.upstreams.length > 1);
    expect(retried.length).toBeGreaterThan(0);
    for (const { upstreams, statuses: upstreamStatuses } of retried) {
      expect(upstreams).toEqual([drainingAddress, otherAddress]);
      expect(upstreamStatuses).toEqual(['503', '200']);
    }
  }, 120_000);
});
