import { connect } from 'node:net';
import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createKey } from './support/api-keys.js';
import { Cluster, MODEL } from './support/cluster.js';
import { waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * A client that leaves while the gateway still decides on its request (here: while the API key's
 * limits are checked in Redis) is noticed: nothing is enqueued, and the key's stream slot and token
 * reservation are given back. Real processes: redis-server, a worker (frozen, so an enqueued job would
 * wait in the queue for all to see), a gateway with AUTH=keys, and a raw HTTP client. Redis is held
 * with `CLIENT PAUSE WRITE` so the gateway's rate-limit script waits for as long as the test needs.
 */
describe('when the client leaves while its request is admitted', () => {
  let cluster: Cluster;
  let worker: WorkerProcess;
  let gateway: GatewayProcess;
  let redis: Redis;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the worker stays frozen (SIGSTOP) while a test acts.
    worker = await cluster.worker({ WORKER_TTL_MS: '60000' });
    // The gateway renews its alive key (a SET) every max(1 s, REGISTRY_POLL_MS) on the connection that
    // runs the admission script: a renewal paused ahead of the script holds the script back in that
    // connection, and the test waited for an EVALSHA Redis never got (CI, stop 46; a 1.5 s sleep after
    // the pause makes it every time). A poll this long renews once, at start; the worker registered
    // before the gateway's first read of the registry.
    gateway = await cluster.gateway({ AUTH: 'keys', REGISTRY_POLL_MS: '600000' });
    redis = cluster.redis.client();
  });

  afterAll(async () => {
    await redis?.call('CLIENT', 'UNPAUSE').catch(() => undefined);
    redis?.disconnect();
    worker?.process.signal('SIGCONT');
    await cluster?.stop();
  });

  const metric = async (name: string, labels: Record<string, string>) =>
    (await scrapePrometheus(`${gateway.url}/metrics`)).value(name, labels);

  /** Redis holds a paused EVALSHA (the key's admission script): the gateway awaits it. */
  const admissionPaused = async () => {
    const clients = String(await redis.call('CLIENT', 'LIST')).split('\n');
    return clients.some((line) => / flags=\w*b\w* /.test(line) && line.includes(' cmd=evalsha ')) ? true : undefined;
  };

  const queuedJobs = async () => {
    const [wait, prioritized] = await Promise.all([
      redis.llen('sluice:bull:generate:wait'),
      redis.zcard('sluice:bull:generate:prioritized'),
    ]);
    return wait + prioritized;
  };

  for (const stream of [false, true]) {
    it(`${stream ? 'streaming' : 'not streaming'}: nothing is enqueued and the key's stream slot is free at once`, async () => {
      const key = await createKey(cluster.redis.url, ['--name', `one-stream-${stream}`, '--max-streams', '1', '--tpm', '100000']);
      const body = JSON.stringify({
        model: MODEL,
        messages: [{ role: 'user', content: 'Hello' }],
        max_tokens: 1500,
        ignore_eos: true,
        stream,
      });
      const closedBefore = await metric('sluice_gateway_rejected_total', { reason: 'client_closed' });
      const leftBefore = await metric('sluice_gateway_requests_total', { route: '/v1/chat/completions', status: '499' });
      worker.process.signal('SIGSTOP');
      try {
        await redis.call('CLIENT', 'PAUSE', '60000', 'WRITE');
        const socket = connect(new URL(gateway.url).port ? Number(new URL(gateway.url).port) : 80, '127.0.0.1');
        socket.on('error', () => undefined);
        await new Promise<void>((resolve) => socket.once('connect', () => resolve()));
        socket.write(
          `POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ${key}\r\n` +
            `Content-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`,
        );
        await waitFor('the gateway to await the key admission', admissionPaused, 10_000);
        socket.destroy();
        // The gateway saw the connection close (its response counted as 499) before Redis answers.
        await waitFor(
          'the gateway to see the client leave',
          async () =>
            (await metric('sluice_gateway_requests_total', { route: '/v1/chat/completions', status: '499' })) > leftBefore
              ? true
              : undefined,
          10_000,
        );
      } finally {
        await redis.call('CLIENT', 'UNPAUSE');
      }
      // Refused as a client that left: counted once, with nothing enqueued for the frozen worker to find.
      await waitFor(
        'the refusal as a client that left',
        async () => ((await metric('sluice_gateway_rejected_total', { reason: 'client_closed' })) === closedBefore + 1 ? true : undefined),
        10_000,
      );
      expect(await queuedJobs()).toBe(0);
      worker.process.signal('SIGCONT');

      // The key's one stream slot was given back: the next request is served, not refused (429 max-streams).
      const next = await fetch(`${gateway.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${key}` },
        body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 }),
      });
      expect(next.status, await next.clone().text()).toBe(200);
      await next.json();
    });
  }
});
