import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { parse, stringify } from 'yaml';
import { Cluster, MODEL } from './support/cluster.js';
import { startFrozenMidAnswers } from './support/mid-answer.js';
import { sleep, waitFor } from './support/processes.js';
import { hasPrometheus, startPrometheus, type PrometheusServer } from './support/prometheus-server.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { LiveStream, streamError } from './support/sse.js';

/**
 * The shipped dashboard and rules, proven on a real Prometheus: the shipped `prometheus.yml` (its
 * targets pointed at this test's gateway and worker, intervals shortened) scrapes a real gateway and
 * worker while the test drives traffic, incidents included (429s, queue timeouts before and after
 * the 200, a client that leaves). Then every panel query of the Grafana dashboard must return data,
 * and every shipped rule must evaluate without error; stopping the worker raises SluiceNoLiveWorkers,
 * the requests the gateway then refuses (503 no_workers, no outcome) raise SluiceGateway5xxRatioHigh,
 * and stopping the gateway raises SluiceGatewayDown and SluiceNoLiveGateways. The alerts are seen
 * pending (their `for:` is minutes); test/prometheus-alert-rules.promtool.yml checks when they fire.
 */

const deploy = (path: string) => fileURLToPath(new URL(`../deploy/${path}`, import.meta.url));
const dashboard = JSON.parse(readFileSync(deploy('grafana/dashboards/sluice.json'), 'utf8')) as {
  panels: Array<{ title: string; targets?: Array<{ expr: string }> }>;
};
/** Grafana's `$__rate_interval`, widened to cover the whole short test. */
const RATE_INTERVAL = '1m';

interface ScrapeConfig {
  job_name: string;
  static_configs?: Array<{ targets: string[] }>;
  dns_sd_configs?: unknown;
}

describe.skipIf(!hasPrometheus())('the Grafana dashboard and the alert rules on a real Prometheus', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let worker: WorkerProcess;
  let prometheus: PrometheusServer;

  const post = (path: string, body: Record<string, unknown>, signal?: AbortSignal) =>
    fetch(`${gateway.url}${path}`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ model: MODEL, max_tokens: 12, temperature: 0, ...body }),
      ...(signal === undefined ? {} : { signal }),
    });
  const chat = (extra: Record<string, unknown> = {}) =>
    post('/v1/chat/completions', { messages: [{ role: 'user', content: 'Hello' }], ...extra });

  /** Ordinary traffic for `ms`: streams, complete replies, and a client that leaves mid-stream. */
  async function traffic(ms: number): Promise<void> {
    const until = Date.now() + ms;
    while (Date.now() < until) {
      const leaving = new AbortController();
      const left = chat({ stream: true, max_tokens: 200, ignore_eos: true }).then(async (res) => {
        const reader = res.body!.getReader();
        await reader.read();
        leaving.abort();
      });
      void left;
      await Promise.all([
        chat({ stream: true, stream_options: { include_usage: true } }).then((r) => r.text()),
        post('/v1/completions', { prompt: 'Once upon a time' }).then((r) => r.text()),
        fetch(`${gateway.url}/v1/models`).then((r) => r.text()),
      ]);
      await left.catch(() => undefined);
      await sleep(200);
    }
  }

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the worker frozen for the incidents below (SIGSTOP) is not "lost" (Prometheus sees a
    // stopped worker as down, not the registry: the alert below still fires).
    worker = await cluster.worker({ WORKER_TTL_MS: '60000' });
    // Small bounds, so the incidents below happen in seconds.
    gateway = await cluster.gateway({ QUEUE_TIMEOUT_MS: '5000', HEADERS_WAIT_MS: '100', MAX_QUEUED_REQUESTS: '3' });
    const shipped = parse(readFileSync(deploy('prometheus/prometheus.yml'), 'utf8')) as {
      global: Record<string, string>;
      rule_files: string[];
      scrape_configs: ScrapeConfig[];
    };
    expect(shipped.scrape_configs.map((c) => c.job_name)).toEqual(['gateway', 'worker', 'prometheus']);
    const targets: Record<string, string> = {
      gateway: new URL(gateway.url).host,
      worker: new URL(worker.healthUrl).host,
    };
    const config = {
      ...shipped,
      global: { ...shipped.global, scrape_interval: '1s', scrape_timeout: '900ms', evaluation_interval: '1s' },
      scrape_configs: shipped.scrape_configs.map(({ dns_sd_configs: _dns, ...job }) =>
        job.job_name === 'prometheus' ? job : { ...job, static_configs: [{ targets: [targets[job.job_name]!] }] },
      ),
    };
    // The rule files as shipped, next to the config (prometheus.yml names them relatively).
    const files = Object.fromEntries(shipped.rule_files.map((name) => [name, readFileSync(deploy(`prometheus/${name}`), 'utf8')]));
    prometheus = await startPrometheus(stringify(config), files);
    // The prometheus job scrapes localhost:9090 as shipped; point it at this server.
    await waitFor(
      'gateway and worker scraped',
      async () => {
        const up = await prometheus.query('up{job=~"gateway|worker"} == 1');
        return up.length === 2 ? true : undefined;
      },
      30_000,
      200,
    );

    await traffic(5_000);
    // Incidents. A stream error: Redis loses a running request's data (its log and meta) and the
    // gateway's subscriber reconnects, so the open stream repairs itself from a log that is gone and
    // fails with a stream_interrupted error frame. The worker is frozen with the stream mid-answer (see
    // mid-answer.ts): the tiny model could end it before a starved test gets there.
    const redis = cluster.redis.client();
    try {
      const { streams } = await startFrozenMidAnswers([worker], redis, {
        start: () => [
          new LiveStream(`${gateway.url}/v1/chat/completions`, {
            model: MODEL,
            messages: [{ role: 'user', content: 'Hello' }],
            max_tokens: 1800,
            ignore_eos: true,
            temperature: 0,
            stream: true,
          }),
        ],
        progress: (stream) => stream.until('a content chunk', () => stream.contentChunks >= 1),
        maxTokens: 1800,
      });
      const first = streams[0]!;
      await redis.del(`sluice:{${first.jobId}}:log`, `sluice:{${first.jobId}}:meta`);
      await redis.call('CLIENT', 'KILL', 'TYPE', 'pubsub');
      expect(await first.ended).toBe('done');
      expect(streamError(first.items)).toMatchObject({ code: 'stream_interrupted' });

      // The worker still frozen: 3 requests fill the queue (MAX_QUEUED_REQUESTS), 2 more get a 429; the
      // 3 time out in the queue: two before their 200 (503), one stream after it (an error frame).
      const queued = [chat(), chat(), chat({ stream: true })].map((p) => p.then(async (r) => ({ status: r.status, body: await r.text() })));
      // All 3 counted as queued: each session opens before its job is enqueued, and no worker takes one.
      await waitFor('3 jobs waiting in Redis', async () => ((await redis.llen('sluice:bull:generate:wait')) === 3 ? true : undefined));
      const refused = await Promise.all([chat(), chat()]);
      expect(refused.map((r) => r.status)).toEqual([429, 429]);
      const timedOut = await Promise.all(queued);
      expect(timedOut.map((r) => r.status)).toEqual([503, 503, 200]);
      expect(timedOut[2]!.body).toContain('queue_timeout');
    } finally {
      worker.process.signal('SIGCONT');
      redis.disconnect();
    }
    await traffic(5_000);
  }, 120_000);

  afterAll(async () => {
    await prometheus?.stop();
    await cluster?.stop();
  });

  const panelQueries = dashboard.panels.flatMap((panel) =>
    (panel.targets ?? []).map((target) => ({ title: panel.title, expr: target.expr })),
  );

  it('has panel queries to check', () => {
    expect(panelQueries.length).toBeGreaterThan(40);
  });

  it.each(panelQueries.map((q) => [q.title, q.expr] as const))('panel "%s" returns data: %s', async (_title, expr) => {
    const result = await prometheus.query(expr.replaceAll('$__rate_interval', RATE_INTERVAL));
    expect(result.length, expr).toBeGreaterThan(0);
  });

  it('evaluates every shipped recording and alert rule without error', async () => {
    const shipped = parse(readFileSync(deploy('prometheus/alerts.yml'), 'utf8')) as {
      groups: Array<{ rules: Array<{ record?: string; alert?: string }> }>;
    };
    const names = shipped.groups.flatMap((g) => g.rules.map((r) => r.record ?? r.alert));
    const rules = await waitFor(
      'every rule evaluated',
      async () => {
        const all = (await prometheus.rules()).flatMap((g) => g.rules);
        return all.length === names.length && all.every((r) => r.health === 'ok') ? all : undefined;
      },
      15_000,
      200,
    );
    expect(rules.map((r) => r.name).sort()).toEqual([...names].sort());
    for (const rule of rules) expect(rule.lastError ?? '', rule.name).toBe('');
    // Recording rules record data.
    for (const rule of rules.filter((r) => r.type === 'recording')) expect((await prometheus.query(rule.name)).length, rule.name).toBe(1);
    // All is well: no alert fires (the worker is back and traffic is fine; the incidents' few 503s page no one).
    expect(await prometheus.query('sluice:live_workers:count')).toMatchObject([{ value: [expect.any(Number), '1'] }]);
    expect(await prometheus.query('sluice:live_gateways:count')).toMatchObject([{ value: [expect.any(Number), '1'] }]);
    const alerts = rules.filter((r) => r.type === 'alerting');
    expect(alerts.filter((r) => r.state !== 'inactive').map((r) => r.name)).toEqual([]);
  });

  /** The alert rule `name` once it is pending or firing. */
  const active = async (name: string) => {
    const rule = (await prometheus.rules()).flatMap((g) => g.rules).find((r) => r.name === name);
    return rule?.state === 'pending' || rule?.state === 'firing' ? rule : undefined;
  };

  it('raises SluiceNoLiveWorkers when the last worker stops', async () => {
    await worker.process.stop(5_000);
    const alert = await waitFor('SluiceNoLiveWorkers active', () => active('SluiceNoLiveWorkers'), 20_000, 250);
    expect(alert.health).toBe('ok');
  });

  it('raises SluiceGateway5xxRatioHigh while the gateway refuses every request before any work', async () => {
    // The stopped worker left the registry: every request is a 503 no_workers, which has no outcome, so
    // the error ratio cannot see it (a worker up but unregistered, or Redis down, looks the same).
    const statuses: number[] = [];
    const alert = await waitFor(
      'SluiceGateway5xxRatioHigh active',
      async () => {
        const batch = Array.from({ length: 10 }, async () => {
          const res = await chat();
          await res.text();
          return res.status;
        });
        statuses.push(...(await Promise.all(batch)));
        return active('SluiceGateway5xxRatioHigh');
      },
      30_000,
      250,
    );
    expect(alert.health).toBe('ok');
    expect(statuses.filter((status) => status === 503).length).toBeGreaterThan(10);
    // The refusals were no_workers (the counter itself: its series starts at its first refusal, so a
    // rate over it may still have a single sample, and be empty).
    const refused = await prometheus.query('sum(sluice_gateway_rejected_total{reason="no_workers"})');
    expect(Number(refused[0]?.value[1])).toBeGreaterThan(0);
  });

  it('raises SluiceGatewayDown and SluiceNoLiveGateways when the gateway stops', async () => {
    await gateway.process.stop(5_000);
    const down = await waitFor('SluiceGatewayDown active', () => active('SluiceGatewayDown'), 20_000, 250);
    expect(down.health).toBe('ok');
    const none = await waitFor('SluiceNoLiveGateways active', () => active('SluiceNoLiveGateways'), 20_000, 250);
    expect(none.health).toBe('ok');
  });
});
