import { Agent, request, type ClientRequest } from 'node:http';
import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { startFrozenMidAnswers, thaw } from './support/mid-answer.js';
import { sleep, waitFor } from './support/processes.js';
import { hasPrometheus, startPrometheus, type PrometheusServer } from './support/prometheus-server.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { checkChunkSequence, LiveStream } from './support/sse.js';

/**
 * A stopping gateway or worker used to exit as soon as its drain was done: the counts of its last
 * requests (the outcome of a stream it drained, a worker's last tokens) were made after its last
 * scrape, and its series went with the process, so Prometheus never saw them. With
 * FINAL_SCRAPE_MAX_MS each waits for one more scrape first. Real Prometheus (1 s scrapes), gateway,
 * worker and redis-server; the one stream is held mid-answer by freezing the worker (SIGSTOP) while
 * both get SIGTERM, so its end comes during their drains.
 */
const MAX_TOKENS = 600;

describe.skipIf(!hasPrometheus())('a drained process waits for a last scrape (FINAL_SCRAPE_MAX_MS)', () => {
  let cluster: Cluster;
  let redis: Redis;
  let worker: WorkerProcess;
  let gateway: GatewayProcess;
  let prometheus: PrometheusServer;

  beforeAll(async () => {
    cluster = await Cluster.start();
    worker = await cluster.worker({ WORKER_TTL_MS: '60000', FINAL_SCRAPE_MAX_MS: '10000' });
    gateway = await cluster.gateway({ FINAL_SCRAPE_MAX_MS: '10000' });
    redis = cluster.redis.client();
    const target = (url: string) => new URL(url).host;
    prometheus = await startPrometheus(
      [
        'global: { scrape_interval: 1s, scrape_timeout: 900ms }',
        'scrape_configs:',
        `  - { job_name: gateway, static_configs: [{ targets: ['${target(gateway.url)}'] }] }`,
        `  - { job_name: worker, static_configs: [{ targets: ['${target(worker.healthUrl)}'] }] }`,
      ].join('\n'),
    );
  });

  afterAll(async () => {
    thaw([worker]);
    redis?.disconnect();
    await prometheus?.stop();
    await cluster?.stop();
  });

  it("has Prometheus read the drained stream's outcome and the worker's last tokens before they exit", async () => {
    // Both scraped at a steady pace: two scrapes each.
    await waitFor(
      'gateway and worker scraped twice',
      async () => ((await prometheus.query('count_over_time(up[1m]) >= 2')).length === 2 ? true : undefined),
      30_000,
      200,
    );
    const { streams } = await startFrozenMidAnswers([worker], redis, {
      start: () => [
        new LiveStream(`${gateway.url}/v1/chat/completions`, {
          model: MODEL,
          stream: true,
          max_tokens: MAX_TOKENS,
          ignore_eos: true,
          messages: [{ role: 'user', content: 'Tell a long story.' }],
        }),
      ],
      progress: (s) => s.until('streaming', () => s.contentChunks >= 3),
      maxTokens: MAX_TOKENS,
    });
    const stream = streams[0]!;
    // SIGTERM reaches the frozen worker when it runs again; the gateway starts draining now.
    worker.process.signal('SIGTERM');
    gateway.process.signal('SIGTERM');
    thaw([worker]);
    expect(await stream.ended).toBe('done');
    expect(checkChunkSequence(stream.items, 'chat', false).finishReason).toBe('length');
    const [gatewayExit, workerExit] = await Promise.all([gateway.process.exited, worker.process.exited]);
    expect(gatewayExit.code).toBe(0);
    expect(workerExit.code).toBe(0);

    const last = async (expr: string) => Number((await prometheus.query(`last_over_time(${expr}[5m])`))[0]?.value[1] ?? NaN);
    expect(await last('sluice_gateway_request_outcomes_total{outcome="length"}')).toBe(1);
    expect(await last('sluice_gateway_stream_tokens_total')).toBe(MAX_TOKENS);
    expect(await last('sluice_generation_tokens_total')).toBe(MAX_TOKENS);
  });
});

describe('a stopping gateway under a keep-alive connection that keeps asking', () => {
  let cluster: Cluster;

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker();
  });

  afterAll(async () => {
    await cluster?.stop();
  });

  it('closes a connection that was busy when it closed, once idle, and exits (it served it on and on)', async () => {
    const gateway = await cluster.gateway();
    const agent = new Agent({ keepAlive: true, maxSockets: 1 });
    const { port } = new URL(gateway.url);
    const reply = (req: ClientRequest) =>
      new Promise<number>((resolve, reject) =>
        req
          .on('response', (res) => {
            res.resume();
            res.on('end', () => resolve(res.statusCode ?? 0));
          })
          .on('error', reject),
      );
    // A request in flight when the gateway stops: its body not sent yet.
    const busy = request({
      host: '127.0.0.1',
      port,
      path: '/v1/completions',
      method: 'POST',
      agent,
      headers: { 'content-type': 'application/json' },
    });
    const answered = reply(busy);
    busy.write('{"model":');
    await sleep(300);
    gateway.process.signal('SIGTERM');
    await sleep(300);
    busy.end(`"${MODEL}","prompt":"x","max_tokens":1}`);
    expect(await answered).toBe(503);
    // Then a scraper's requests on the same keep-alive connection, every 200 ms, until the gateway is gone.
    let asking = true;
    const scraper = (async () => {
      while (asking) {
        await reply(request({ host: '127.0.0.1', port, path: '/metrics', agent }).end()).catch(() => (asking = false));
        await sleep(200);
      }
    })();
    const exit = await waitFor(
      'the gateway exited',
      () => Promise.race([gateway.process.exited, sleep(100).then(() => undefined)]),
      20_000,
    );
    asking = false;
    await scraper;
    agent.destroy();
    expect(exit.code).toBe(0);
  });
});
