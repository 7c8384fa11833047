import { readFileSync } from 'node:fs';
import { parser } from '@prometheus-io/lezer-promql';
import { describe, expect, it } from 'vitest';
import { parse as parseYaml } from 'yaml';
import { metricCatalog, seriesNames, type MetricInfo } from './support/catalog.js';

type SyntaxNode = ReturnType<typeof parser.parse>['topNode'];

const root = new URL('../../../', import.meta.url);
const readText = (path: string) => readFileSync(new URL(path, root), 'utf8');

interface Target {
  refId: string;
  expr: string;
  datasource?: { type: string; uid: string };
}
interface Panel {
  id: number;
  type: string;
  title: string;
  gridPos: { x: number; y: number; w: number; h: number };
  datasource?: { type: string; uid: string };
  targets?: Target[];
}
interface Dashboard {
  uid: string;
  title: string;
  schemaVersion: number;
  panels: Panel[];
  templating: { list: Array<{ name: string; type: string; query: string }> };
}

const dashboard = JSON.parse(readText('deploy/grafana/dashboards/sluice.json')) as Dashboard;
const graphPanels = dashboard.panels.filter((panel) => panel.type !== 'row');
const catalog = metricCatalog();
/** Series name → the metric it belongs to, for every series our processes expose. */
const exposed = new Map<string, MetricInfo>(catalog.flatMap((metric) => seriesNames(metric).map((name) => [name, metric] as const)));

interface Selector {
  metric: string;
  /** The function the selector is an argument of (`rate`, `histogram_quantile`, ...), if any. */
  functionName: string | undefined;
}
interface ParsedExpr {
  errors: string[];
  selectors: Selector[];
  /** Each histogram_quantile call: its quantile, grouping labels and the selectors inside. */
  quantiles: Array<{ q: number; by: string[]; metrics: string[] }>;
}

/** Parses a panel expression with Prometheus's own PromQL grammar, after Grafana's variables. */
function parsePromQL(expr: string): ParsedExpr {
  const text = expr.replace(/\$__(rate_interval|interval|range)\b/g, '5m');
  const tree = parser.parse(text);
  const slice = (node: SyntaxNode) => text.slice(node.from, node.to);
  const result: ParsedExpr = { errors: [], selectors: [], quantiles: [] };
  tree.iterate({
    enter: (ref) => {
      const node = ref.node;
      if (node.type.isError) result.errors.push(`syntax error at ${node.from} in ${text}`);
      if (node.name === 'VectorSelector') {
        const identifier = node.getChild('Identifier');
        if (identifier === null) result.errors.push(`selector without a metric name: ${slice(node)}`);
        else result.selectors.push({ metric: slice(identifier), functionName: enclosingFunction(node, slice) });
      }
      if (node.name === 'FunctionCall' && functionName(node, slice) === 'histogram_quantile') {
        const body = node.getChild('FunctionCallBody');
        const q = body?.getChild('NumberDurationLiteral');
        const by = body?.getChild('AggregateExpr')?.getChild('AggregateModifier')?.getChild('GroupingLabels');
        const metrics: string[] = [];
        if (body !== null && body !== undefined) {
          body.toTree().iterate({
            enter: (inner) => {
              if (inner.name === 'Identifier' && inner.node.parent?.name === 'VectorSelector') {
                metrics.push(text.slice(body.from + inner.from, body.from + inner.to));
              }
            },
          });
        }
        result.quantiles.push({
          q: q === null || q === undefined ? NaN : Number(slice(q)),
          by: by === null || by === undefined ? [] : by.getChildren('LabelName').map(slice),
          metrics,
        });
      }
    },
  });
  return result;
}

function functionName(call: SyntaxNode, slice: (node: SyntaxNode) => string): string | undefined {
  const identifier = call.getChild('FunctionIdentifier');
  return identifier === null ? undefined : slice(identifier);
}

function enclosingFunction(node: SyntaxNode, slice: (node: SyntaxNode) => string): string | undefined {
  for (let parent = node.parent; parent !== null; parent = parent.parent) {
    if (parent.name === 'FunctionCall') return functionName(parent, slice);
    if (parent.name === 'AggregateExpr' || parent.name === 'BinaryExpr') return undefined;
  }
  return undefined;
}

const targets = graphPanels.flatMap((panel) =>
  (panel.targets ?? []).map((target) => ({ panel, target, parsed: parsePromQL(target.expr) })),
);

describe('the Grafana dashboard', () => {
  it('is a dashboard with a Prometheus data source variable that its panels use', () => {
    expect(dashboard.uid).toMatch(/^[\w-]{1,40}$/);
    expect(dashboard.title).toBe('Sluice');
    expect(dashboard.schemaVersion).toBeGreaterThanOrEqual(36);
    expect(dashboard.templating.list).toContainEqual(
      expect.objectContaining({ name: 'datasource', type: 'datasource', query: 'prometheus' }),
    );
    for (const panel of graphPanels) {
      expect(panel.datasource, panel.title).toEqual({ type: 'prometheus', uid: '${datasource}' });
      for (const target of panel.targets ?? []) expect(target.datasource, panel.title).toEqual(panel.datasource);
    }
  });

  it('lays out panels with unique ids on the 24-column grid without overlaps', () => {
    const ids = dashboard.panels.map((panel) => panel.id);
    expect(new Set(ids).size).toBe(ids.length);
    const taken = new Set<string>();
    for (const { title, gridPos } of dashboard.panels) {
      expect(gridPos.w, title).toBeGreaterThan(0);
      expect(gridPos.h, title).toBeGreaterThan(0);
      expect(gridPos.x + gridPos.w, title).toBeLessThanOrEqual(24);
      for (let x = gridPos.x; x < gridPos.x + gridPos.w; x++) {
        for (let y = gridPos.y; y < gridPos.y + gridPos.h; y++) {
          expect(taken.has(`${x},${y}`), `${title} overlaps at ${x},${y}`).toBe(false);
          taken.add(`${x},${y}`);
        }
      }
    }
  });

  it('gives every panel queries with unique refIds', () => {
    for (const panel of graphPanels) {
      const refIds = (panel.targets ?? []).map((target) => target.refId);
      expect(refIds.length, panel.title).toBeGreaterThan(0);
      expect(new Set(refIds).size, panel.title).toBe(refIds.length);
    }
  });

  it('writes every query in valid PromQL', () => {
    for (const { panel, parsed } of targets) expect(parsed.errors, panel.title).toEqual([]);
  });

  it('queries only series that the gateway and worker metrics expose', () => {
    for (const { panel, parsed } of targets) {
      for (const { metric } of parsed.selectors) {
        expect(exposed.has(metric), `${panel.title}: ${metric} is not a metric of @sluice/metrics`).toBe(true);
      }
    }
  });

  it('takes rate() only of counters and histogram series, never of gauges', () => {
    for (const { panel, parsed } of targets) {
      for (const { metric, functionName } of parsed.selectors) {
        if (functionName !== 'rate' && functionName !== 'increase') continue;
        expect(exposed.get(metric)?.type, `${panel.title}: rate(${metric})`).toMatch(/^(counter|histogram)$/);
      }
    }
  });

  it('computes quantiles from histogram buckets aggregated by le', () => {
    const quantiles = targets.flatMap(({ panel, parsed }) => parsed.quantiles.map((q) => ({ panel, ...q })));
    expect(quantiles.length).toBeGreaterThan(0);
    for (const { panel, q, by, metrics } of quantiles) {
      expect(q, panel.title).toBeGreaterThan(0);
      expect(q, panel.title).toBeLessThan(1);
      expect(by, panel.title).toContain('le');
      expect(metrics.length, panel.title).toBe(1);
      expect(metrics[0], panel.title).toMatch(/_bucket$/);
    }
  });

  it.each(['sluice_time_to_first_token_seconds', 'sluice_inter_token_latency_seconds', 'sluice_e2e_request_latency_seconds'])(
    'shows p50, p95 and p99 of %s',
    (metric) => {
      const shown = targets.flatMap(({ parsed }) => parsed.quantiles.filter((q) => q.metrics[0] === `${metric}_bucket`).map((q) => q.q));
      expect(shown).toEqual(expect.arrayContaining([0.5, 0.95, 0.99]));
    },
  );

  it('covers throughput, queue depth, batch, KV, steps by phase, disconnects, timeouts, errors, 429s and active streams', () => {
    const used = new Set(targets.flatMap(({ parsed }) => parsed.selectors.map((s) => s.metric)));
    for (const series of [
      'sluice_gateway_requests_total',
      'sluice_gateway_stream_tokens_total',
      'sluice_generation_tokens_total',
      'sluice_worker_queue_jobs',
      'sluice_num_requests_running',
      'sluice_num_requests_waiting',
      'sluice_worker_batch_size_bucket',
      'sluice_kv_cache_usage_perc',
      'sluice_worker_step_seconds_bucket',
      'sluice_worker_model_run_seconds_bucket',
      'sluice_gateway_disconnects_total',
      'sluice_gateway_timeouts_total',
      'sluice_gateway_stream_errors_total',
      'sluice_gateway_rejected_total',
      'sluice_gateway_active_streams',
      'sluice_request_queue_time_seconds_bucket',
    ]) {
      expect(used.has(series), series).toBe(true);
    }
    expect(targets.some(({ target }) => target.expr.includes('status="429"'))).toBe(true);
  });

  it('reads the shared queue depth with max, not sum, since every worker reports the same queue', () => {
    for (const { panel, target } of targets) {
      if (target.expr.includes('sluice_worker_queue_jobs')) expect(target.expr, panel.title).not.toMatch(/\bsum\b/);
    }
  });
});

describe('the Prometheus and Grafana provisioning', () => {
  const prometheus = parseYaml(readText('deploy/prometheus/prometheus.yml')) as {
    scrape_configs: Array<{
      job_name: string;
      metrics_path?: string;
      static_configs?: Array<{ targets: string[] }>;
      dns_sd_configs?: Array<{ names: string[]; type: string; port: number }>;
    }>;
  };
  const job = (name: string) => prometheus.scrape_configs.find((config) => config.job_name === name);

  it('scrapes both gateways on their HTTP port', () => {
    expect(job('gateway')?.static_configs?.flatMap((c) => c.targets)).toEqual(['gateway-1:8080', 'gateway-2:8080']);
    expect(job('gateway')?.metrics_path ?? '/metrics').toBe('/metrics');
  });

  it('finds every replica of the scalable worker service through DNS', () => {
    expect(job('worker')?.dns_sd_configs).toEqual([expect.objectContaining({ names: ['worker'], type: 'A', port: 9464 })]);
  });

  it('provisions the Prometheus data source and the dashboard folder', () => {
    const datasources = parseYaml(readText('deploy/grafana/provisioning/datasources/prometheus.yml')) as {
      datasources: Array<{ type: string; url: string }>;
    };
    expect(datasources.datasources).toContainEqual(expect.objectContaining({ type: 'prometheus', url: 'http://prometheus:9090' }));
    const providers = parseYaml(readText('deploy/grafana/provisioning/dashboards/sluice.yml')) as {
      providers: Array<{ type: string; options: { path: string } }>;
    };
    expect(providers.providers).toContainEqual(expect.objectContaining({ type: 'file', options: { path: '/var/lib/grafana/dashboards' } }));
  });
});
