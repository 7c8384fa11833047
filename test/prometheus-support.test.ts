import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { createWorkerMetrics } from '@sluice/metrics';
import { describe, expect, it } from 'vitest';
import { parsePrometheusText, scrapePrometheus } from './support/prometheus.js';

const histogram = `# HELP step_seconds Step time.
# TYPE step_seconds histogram
step_seconds_bucket{le="0.01",phase="prefill"} 1
step_seconds_bucket{le="0.1",phase="prefill"} 3
step_seconds_bucket{le="+Inf",phase="prefill"} 4
step_seconds_sum{phase="prefill"} 2.5
step_seconds_count{phase="prefill"} 4
step_seconds_bucket{le="0.01",phase="decode"} 7
step_seconds_bucket{le="0.1",phase="decode"} 9
step_seconds_bucket{le="+Inf",phase="decode"} 9
step_seconds_sum{phase="decode"} 0.2
step_seconds_count{phase="decode"} 9
`;

describe('parsePrometheusText', () => {
  it('reads counters and gauges with their labels, help and type', () => {
    const parsed = parsePrometheusText(`# HELP requests_total Requests.
# TYPE requests_total counter
requests_total{route="/v1/chat/completions",status="200"} 3
requests_total{route="/v1/models",status="200"} 1
# HELP active Open streams.
# TYPE active gauge
active 2
`);
    expect(parsed.family('requests_total')).toMatchObject({ type: 'counter', help: 'Requests.' });
    expect(parsed.value('requests_total')).toBe(4);
    expect(parsed.value('requests_total', { route: '/v1/models' })).toBe(1);
    expect(parsed.value('active')).toBe(2);
    expect(parsed.has('missing')).toBe(false);
  });

  it('keeps every series of a labelled histogram apart', () => {
    const parsed = parsePrometheusText(histogram);
    const family = parsed.family('step_seconds');
    expect(family.type).toBe('histogram');
    expect(family.histograms).toEqual([
      {
        labels: { phase: 'prefill' },
        buckets: [
          { le: 0.01, count: 1 },
          { le: 0.1, count: 3 },
          { le: Infinity, count: 4 },
        ],
        sum: 2.5,
        count: 4,
      },
      {
        labels: { phase: 'decode' },
        buckets: [
          { le: 0.01, count: 7 },
          { le: 0.1, count: 9 },
          { le: Infinity, count: 9 },
        ],
        sum: 0.2,
        count: 9,
      },
    ]);
    expect(parsed.histogram('step_seconds')).toMatchObject({
      count: 13,
      sum: 2.7,
      buckets: [
        { le: 0.01, count: 8 },
        { le: 0.1, count: 12 },
        { le: Infinity, count: 13 },
      ],
    });
    expect(parsed.histogram('step_seconds', { phase: 'decode' }).count).toBe(9);
  });

  it('unescapes label values and reads NaN and infinities as Prometheus does', () => {
    const parsed = parsePrometheusText(`# TYPE g gauge
g{path="C:\\\\dir",msg="say \\"hi\\"\\nbye"} 1
# TYPE lag gauge
lag Nan
# TYPE big gauge
big +Inf
`);
    expect(parsed.family('g').samples[0]?.labels).toEqual({ path: 'C:\\dir', msg: 'say "hi"\nbye' });
    expect(parsed.value('lag')).toBeNaN();
    expect(parsed.value('big')).toBe(Infinity);
  });

  it.each([
    ['an unparsable value', '# TYPE a gauge\na one\n', /invalid value/],
    ['a bad metric name', '# TYPE 1a gauge\n1a 1\n', /invalid metric name/],
    ['a bad label', '# TYPE a gauge\na{1x="y"} 1\n', /invalid label name|invalid line/i],
    ['broken label syntax', '# TYPE a gauge\na{x=y} 1\n', /invalid line/i],
    ['a duplicate series', '# TYPE a gauge\na{x="1"} 1\na{x="1"} 2\n', /duplicate series/],
    ['a duplicate unlabelled series', '# TYPE a gauge\na 1\na 2\n', /duplicate series/],
    ['an unknown type', '# TYPE a thing\na 1\n', /unknown type/],
    ['a TYPE line after the samples', 'a 1\n# TYPE a gauge\n', /after its samples/],
    ['two TYPE lines', '# TYPE a gauge\n# TYPE a counter\na 1\n', /second TYPE/],
    ['a negative counter', '# TYPE c_total counter\nc_total -1\n', /negative/],
    ['non-cumulative buckets', histogram.replace('le="0.1",phase="prefill"} 3', 'le="0.1",phase="prefill"} 0'), /not cumulative/],
    ['a missing +Inf bucket', histogram.replace('step_seconds_bucket{le="+Inf",phase="decode"} 9\n', ''), /no \+Inf bucket/],
    [
      'a _count that disagrees with +Inf',
      histogram.replace('step_seconds_count{phase="decode"} 9', 'step_seconds_count{phase="decode"} 8'),
      /!= _count/,
    ],
    ['a histogram without _sum', histogram.replace('step_seconds_sum{phase="decode"} 0.2\n', ''), /lacks _sum/],
  ])('rejects %s', (_, text, error) => {
    expect(() => parsePrometheusText(text)).toThrow(error);
  });
});

describe('scrapePrometheus', () => {
  it('fetches and parses a /metrics endpoint served from a registry', async () => {
    const metrics = createWorkerMetrics();
    metrics.observeRequestFinished({ finishReason: 'stop', usage: { promptTokens: 3, completionTokens: 5 } });
    const server = createServer((req, res) => {
      if (req.url !== '/metrics') return void res.writeHead(404).end();
      metrics.registry.metrics().then(
        (text) => res.writeHead(200, { 'Content-Type': metrics.registry.contentType }).end(text),
        () => res.writeHead(500).end(),
      );
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    try {
      const scraped = await scrapePrometheus(`${base}/metrics`);
      expect(scraped.value('sluice_request_success_total', { finish_reason: 'stop' })).toBe(1);
      expect(scraped.histogram('sluice_request_generation_tokens', { finish_reason: 'stop' }).sum).toBe(5);
      await expect(scrapePrometheus(`${base}/nope`)).rejects.toThrow(/404/);
    } finally {
      await new Promise((resolve) => server.close(resolve));
    }
  });
});
