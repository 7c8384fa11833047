import { collectDefaultMetrics } from 'prom-client';
import { describe, expect, it } from 'vitest';
import { parsePrometheusText, type PrometheusMetrics } from '../../../test/support/prometheus.js';
import { createGatewayMetrics, Registry, type GatewayMetrics } from '../src/index.js';

/** Resolves in a later event-loop turn (a step's chunks are written within one). */
const nextTurn = () => new Promise<void>((resolve) => setImmediate(resolve));

function setup(): { metrics: GatewayMetrics; clock: { ms: number }; scrape: () => Promise<PrometheusMetrics> } {
  const clock = { ms: 0 };
  const metrics = createGatewayMetrics(undefined, { now: () => clock.ms });
  return { metrics, clock, scrape: async () => parsePrometheusText(await metrics.registry.metrics()) };
}

describe('createGatewayMetrics', () => {
  it('registers nothing until called, and each call gets its own registry', async () => {
    const a = createGatewayMetrics();
    const b = createGatewayMetrics();
    expect(a.registry).not.toBe(b.registry);
    a.streamGaps.inc();
    const scraped = parsePrometheusText(await b.registry.metrics());
    expect(scraped.value('sluice_gateway_stream_gaps_total')).toBe(0);
  });

  it('reads readiness at each scrape, and answers 0 within a second when the probe hangs (a stalled Redis)', async () => {
    const { metrics, scrape } = setup();
    expect((await scrape()).value('sluice_gateway_ready')).toBe(0);
    let ready = true;
    metrics.observeReadiness(async () => ready);
    expect((await scrape()).value('sluice_gateway_ready')).toBe(1);
    ready = false;
    expect((await scrape()).value('sluice_gateway_ready')).toBe(0);
    metrics.observeReadiness(() => new Promise<boolean>(() => undefined));
    const started = performance.now();
    expect((await scrape()).value('sluice_gateway_ready')).toBe(0);
    expect(performance.now() - started).toBeLessThan(5_000);
  });

  it('uses the registry it is given', async () => {
    const registry = new Registry();
    const metrics = createGatewayMetrics(registry);
    expect(metrics.registry).toBe(registry);
    expect(await registry.getSingleMetric('sluice_gateway_active_streams')?.get()).toBeDefined();
  });

  it("takes a registry that already has prom-client's default metrics, and still reads its event-loop delay gauges from its own window", async () => {
    const registry = new Registry();
    collectDefaultMetrics({ register: registry });
    const metrics = createGatewayMetrics(registry);
    const scrape = async () => parsePrometheusText(await metrics.scrape());
    const scraped = await scrape();
    expect(scraped.family('process_cpu_user_seconds_total').type).toBe('counter');
    expect(scraped.value('nodejs_eventloop_lag_p50_seconds')).toBe(0);
    // The caller's prom-client monitor keeps ticking every 10 ms: had its gauges stayed, an idle window would read ~0.010.
    await new Promise((resolve) => setTimeout(resolve, 60));
    expect((await scrape()).value('nodejs_eventloop_lag_p50_seconds')).toBe(0);
    const end = metrics.eventLoopDelay.begin();
    await new Promise((resolve) => setTimeout(resolve, 60));
    end();
    expect((await scrape()).value('nodejs_eventloop_lag_p50_seconds')).toBeGreaterThanOrEqual(0.009);
  });

  it('includes the default process metrics', async () => {
    const { scrape } = setup();
    const scraped = await scrape();
    expect(scraped.family('process_cpu_user_seconds_total').type).toBe('counter');
    expect(scraped.family('nodejs_eventloop_lag_seconds').type).toBe('gauge');
    expect(scraped.family('nodejs_heap_size_used_bytes').type).toBe('gauge');
  });

  it("reads the event-loop delay only while requests are open: prom-client's gauges, from a window taken at each scrape", async () => {
    const { metrics } = setup();
    const scrape = async () => parsePrometheusText(await metrics.scrape());
    const lagNames = ['min', 'max', 'mean', 'stddev', 'p50', 'p90', 'p99'].map((q) => `nodejs_eventloop_lag_${q}_seconds`);
    expect(metrics.eventLoopDelay.measuring).toBe(false);
    for (const name of lagNames) expect((await scrape()).value(name), name).toBe(0);
    const end = metrics.eventLoopDelay.begin();
    await new Promise((resolve) => setTimeout(resolve, 60));
    end();
    const busy = await scrape();
    expect(busy.family('nodejs_eventloop_lag_p99_seconds').help).toBe('The 99th percentile of the recorded event loop delays.');
    expect(busy.value('nodejs_eventloop_lag_p50_seconds')).toBeGreaterThanOrEqual(0.009);
    expect(busy.value('nodejs_eventloop_lag_max_seconds')).toBeGreaterThanOrEqual(busy.value('nodejs_eventloop_lag_min_seconds'));
    // The window was taken: an idle one reads 0 again.
    expect((await scrape()).value('nodejs_eventloop_lag_p50_seconds')).toBe(0);
  });

  it('documents every metric with help text', async () => {
    const { scrape } = setup();
    for (const family of (await scrape()).families.values()) expect(family.help, family.name).not.toBe('');
  });

  it('has every outcome, disconnect stage, timeout kind and slow-client cause at 0 from the first scrape (rate() sees the first one)', async () => {
    const scraped = await setup().scrape();
    for (const outcome of ['stop', 'length', 'cancelled', 'detached', 'disconnect', 'timeout', 'slow_client', 'error']) {
      expect(scraped.value('sluice_gateway_request_outcomes_total', { outcome }), outcome).toBe(0);
    }
    for (const stage of ['queued', 'prefill', 'decode']) expect(scraped.value('sluice_gateway_disconnects_total', { stage })).toBe(0);
    for (const kind of ['queue', 'idle', 'deadline']) expect(scraped.value('sluice_gateway_timeouts_total', { kind }), kind).toBe(0);
    for (const cause of ['buffer', 'stall']) expect(scraped.value('sluice_gateway_slow_clients_total', { cause }), cause).toBe(0);
  });

  it('counts responses by route and status', async () => {
    const { metrics, scrape } = setup();
    metrics.countRequest('/v1/chat/completions', 200);
    metrics.countRequest('/v1/chat/completions', 200);
    metrics.countRequest('/v1/chat/completions', 429);
    metrics.countRequest('/v1/models', 200);
    const scraped = await scrape();
    expect(scraped.value('sluice_gateway_requests_total', { route: '/v1/chat/completions', status: '200' })).toBe(2);
    expect(scraped.value('sluice_gateway_requests_total', { status: '429' })).toBe(1);
    expect(scraped.value('sluice_gateway_requests_total')).toBe(4);
  });

  it('counts SSE frames and bytes by kind', async () => {
    const { metrics, scrape } = setup();
    metrics.sseWritten('chunk', 120);
    metrics.sseWritten('chunk', 80);
    metrics.sseWritten('heartbeat', 8);
    metrics.sseWritten('done', 14);
    const scraped = await scrape();
    expect(scraped.value('sluice_gateway_sse_events_total', { kind: 'chunk' })).toBe(2);
    expect(scraped.value('sluice_gateway_sse_bytes_total', { kind: 'chunk' })).toBe(200);
    expect(scraped.value('sluice_gateway_sse_events_total')).toBe(4);
    expect(scraped.value('sluice_gateway_sse_bytes_total')).toBe(222);
    expect(scraped.value('sluice_gateway_sse_events_total', { kind: 'error' })).toBe(0);
  });

  describe('a tracked stream that completes', () => {
    it('records queue time, time to first token, inter-token gaps, tokens and end-to-end latency', async () => {
      const { metrics, clock, scrape } = setup();
      clock.ms = 1000;
      const request = metrics.trackRequest({ stream: true, receivedAt: 990 });
      expect((await scrape()).value('sluice_gateway_active_streams')).toBe(1);
      clock.ms = 1030;
      request.started();
      expect(request.stage).toBe('prefill');
      request.contentWritten(0); // the role-only first chunk is not content
      // Each step's chunks reach the gateway in their own message, written in its own event-loop turn.
      await nextTurn();
      clock.ms = 1240;
      request.contentWritten(1);
      await nextTurn();
      clock.ms = 1242;
      request.contentWritten(2);
      await nextTurn();
      clock.ms = 1250;
      request.contentWritten(1);
      clock.ms = 1251;
      request.finish('stop');

      const scraped = await scrape();
      const queue = scraped.histogram('sluice_request_queue_time_seconds');
      expect(queue.count).toBe(1);
      expect(queue.sum).toBeCloseTo(0.04, 9);
      const ttft = scraped.histogram('sluice_time_to_first_token_seconds');
      expect(ttft.count).toBe(1);
      expect(ttft.sum).toBeCloseTo(0.25, 9);
      expect(ttft.buckets.find((b) => b.le === 0.2)?.count).toBe(0);
      expect(ttft.buckets.find((b) => b.le === 0.3)?.count).toBe(1);
      const itl = scraped.histogram('sluice_inter_token_latency_seconds');
      expect(itl.count).toBe(2);
      expect(itl.sum).toBeCloseTo(0.01, 9);
      expect(itl.buckets.find((b) => b.le === 0.002)?.count).toBe(1); // the 2 ms gap, resolved
      expect(itl.buckets.find((b) => b.le === 0.0075)?.count).toBe(1);
      expect(itl.buckets.find((b) => b.le === 0.01)?.count).toBe(2);
      expect(scraped.histogram('sluice_e2e_request_latency_seconds').sum).toBeCloseTo(0.261, 9);
      expect(scraped.value('sluice_gateway_stream_tokens_total')).toBe(4);
      expect(scraped.value('sluice_gateway_request_outcomes_total', { outcome: 'stop' })).toBe(1);
      expect(scraped.value('sluice_gateway_request_outcomes_total')).toBe(1);
      expect(scraped.value('sluice_gateway_active_streams')).toBe(0);
    });

    it('times a step whose n > 1 choices came as several chunks as one gap, not one per chunk', async () => {
      const { metrics, clock, scrape } = setup();
      const request = metrics.trackRequest({ stream: true, receivedAt: 0 });
      request.started();
      for (let step = 0; step < 5; step++) {
        clock.ms = 100 + 20 * step;
        for (let choice = 0; choice < 4; choice++) request.contentWritten(1);
        await nextTurn();
      }
      request.finish('length');
      const scraped = await scrape();
      const itl = scraped.histogram('sluice_inter_token_latency_seconds');
      expect(itl.count).toBe(4);
      expect(itl.sum).toBeCloseTo(0.08, 9);
      expect(scraped.histogram('sluice_time_to_first_token_seconds').count).toBe(1);
      expect(scraped.value('sluice_gateway_stream_tokens_total')).toBe(20);
    });

    it('counts the ending once, whatever fires after it', async () => {
      const { metrics, scrape } = setup();
      const request = metrics.trackRequest({ stream: true });
      request.started();
      request.contentWritten(3);
      request.finish('length');
      request.disconnect();
      request.fail('internal');
      request.contentWritten(5);
      const scraped = await scrape();
      expect(request.ended).toBe(true);
      expect(scraped.value('sluice_gateway_request_outcomes_total')).toBe(1);
      expect(scraped.value('sluice_gateway_request_outcomes_total', { outcome: 'length' })).toBe(1);
      expect(scraped.value('sluice_gateway_disconnects_total')).toBe(0);
      expect(scraped.value('sluice_gateway_stream_tokens_total')).toBe(3);
      expect(scraped.value('sluice_gateway_active_streams')).toBe(0);
    });
  });

  describe('when the client disconnects', () => {
    it('counts the disconnect by the stage the request was in', async () => {
      const { metrics, scrape } = setup();
      metrics.trackRequest({ stream: true }).disconnect();
      const prefilling = metrics.trackRequest({ stream: true });
      prefilling.started();
      prefilling.disconnect();
      for (let i = 0; i < 2; i++) {
        const decoding = metrics.trackRequest({ stream: true });
        decoding.started();
        decoding.contentWritten(1);
        decoding.disconnect();
      }
      const scraped = await scrape();
      expect(scraped.value('sluice_gateway_disconnects_total', { stage: 'queued' })).toBe(1);
      expect(scraped.value('sluice_gateway_disconnects_total', { stage: 'prefill' })).toBe(1);
      expect(scraped.value('sluice_gateway_disconnects_total', { stage: 'decode' })).toBe(2);
      expect(scraped.value('sluice_gateway_request_outcomes_total', { outcome: 'disconnect' })).toBe(4);
      expect(scraped.histogram('sluice_e2e_request_latency_seconds').count).toBe(0);
      expect(scraped.value('sluice_gateway_active_streams')).toBe(0);
    });

    it('counts a cancelled answer among the outcomes but not in the end-to-end latency (whole answers only)', async () => {
      const { metrics, scrape } = setup();
      const cancelled = metrics.trackRequest({ stream: true });
      cancelled.started();
      cancelled.contentWritten(1);
      cancelled.finish('cancelled');
      const scraped = await scrape();
      expect(scraped.value('sluice_gateway_request_outcomes_total', { outcome: 'cancelled' })).toBe(1);
      expect(scraped.histogram('sluice_e2e_request_latency_seconds').count).toBe(0);
    });
  });

  it('counts timeouts by kind and errors by code', async () => {
    const { metrics, scrape } = setup();
    metrics.trackRequest({ stream: true }).timeout('queue');
    metrics.trackRequest({ stream: true }).timeout('idle');
    metrics.trackRequest({ stream: false }).timeout('queue');
    metrics.trackRequest({ stream: true }).fail('stream_interrupted');
    const scraped = await scrape();
    expect(scraped.value('sluice_gateway_timeouts_total', { kind: 'queue' })).toBe(2);
    expect(scraped.value('sluice_gateway_timeouts_total', { kind: 'idle' })).toBe(1);
    expect(scraped.value('sluice_gateway_stream_errors_total', { code: 'stream_interrupted' })).toBe(1);
    expect(scraped.value('sluice_gateway_request_outcomes_total', { outcome: 'timeout' })).toBe(3);
    expect(scraped.value('sluice_gateway_request_outcomes_total', { outcome: 'error' })).toBe(1);
  });

  it('gives a non-streaming request end-to-end latency and tokens, but no TTFT, ITL or active stream', async () => {
    const { metrics, clock, scrape } = setup();
    const request = metrics.trackRequest({ stream: false });
    expect((await scrape()).value('sluice_gateway_active_streams')).toBe(0);
    request.started();
    clock.ms = 500;
    request.contentWritten(7);
    request.finish('stop');
    const scraped = await scrape();
    expect(scraped.histogram('sluice_time_to_first_token_seconds').count).toBe(0);
    expect(scraped.histogram('sluice_inter_token_latency_seconds').count).toBe(0);
    expect(scraped.histogram('sluice_e2e_request_latency_seconds').sum).toBeCloseTo(0.5, 9);
    expect(scraped.value('sluice_gateway_stream_tokens_total')).toBe(7);
    expect(scraped.value('sluice_gateway_active_streams')).toBe(0);
  });

  it('records no queue time when content arrives without a start', async () => {
    const { metrics, scrape } = setup();
    const request = metrics.trackRequest({ stream: true });
    request.contentWritten(1);
    expect(request.stage).toBe('decode');
    request.started();
    expect((await scrape()).histogram('sluice_request_queue_time_seconds').count).toBe(0);
  });

  it('counts rejections by reason and stream gaps', async () => {
    const { metrics, scrape } = setup();
    metrics.rejected.labels('queue_full').inc();
    metrics.rejected.labels('invalid_request').inc(2);
    metrics.streamGaps.inc();
    const scraped = await scrape();
    expect(scraped.value('sluice_gateway_rejected_total', { reason: 'invalid_request' })).toBe(2);
    expect(scraped.value('sluice_gateway_rejected_total')).toBe(3);
    expect(scraped.value('sluice_gateway_stream_gaps_total')).toBe(1);
  });
});
