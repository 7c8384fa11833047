import { Histogram, Registry } from 'prom-client';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { spyOnPromClient } from '../../../test/support/prom-client-spy.js';
import { INTER_TOKEN_LATENCY_BUCKETS, createGatewayMetrics, PendingHistogram } from '../src/index.js';

afterEach(() => {
  vi.restoreAllMocks();
});

describe('PendingHistogram', () => {
  it('scrapes exactly as if every value had been observed by prom-client, across several scrapes', async () => {
    const values = [0, 0.0004, 0.001, 0.0099, 0.02, 0.02, 0.35, 7, 1e6];
    const direct = new Histogram({ name: 'direct', help: 'h', buckets: [...INTER_TOKEN_LATENCY_BUCKETS], registers: [] });
    const pending = new PendingHistogram(INTER_TOKEN_LATENCY_BUCKETS);
    const folded: Histogram = new Histogram({
      name: 'folded',
      help: 'h',
      buckets: [...INTER_TOKEN_LATENCY_BUCKETS],
      registers: [],
      collect: () => pending.fold(folded),
    });
    const read = async (h: Histogram) => (await h.get()).values.map((v) => [v.metricName?.replace(/^\w+?_/, ''), v.labels['le'], v.value]);
    for (const v of values.slice(0, 4)) {
      direct.observe(v);
      pending.observe(v);
    }
    expect(await read(folded)).toEqual(await read(direct));
    for (const v of values.slice(4)) {
      direct.observe(v);
      pending.observe(v);
    }
    expect(pending.pending).toBe(5);
    expect(await read(folded)).toEqual(await read(direct));
    expect(pending.pending).toBe(0);
    // A reset (registry.resetMetrics()) drops the series; folding recreates it.
    folded.reset();
    direct.reset();
    pending.observe(0.003);
    direct.observe(0.003);
    expect(await read(folded)).toEqual(await read(direct));
  });
});

describe('a tracked stream on the write path', () => {
  it('calls no prom-client method per token: tokens, TTFT and ITL are folded in when scraped', async () => {
    const calls = spyOnPromClient();
    let ms = 0;
    const metrics = createGatewayMetrics(new Registry(), { now: () => ms });
    const tracker = metrics.trackRequest({ stream: true, receivedAt: 0 });
    tracker.started();
    calls.length = 0;
    for (let step = 0; step < 200; step++) {
      ms += 5;
      tracker.contentWritten(2);
      metrics.sseWritten('chunk', 120);
      // Each step's chunks are written in their own event-loop turn (one gateway message each).
      await new Promise<void>((resolve) => setImmediate(resolve));
    }
    tracker.tokensWithoutText(1);
    expect(calls).toEqual([]);
    tracker.finish('length');
    // The spies are live: a request's end is counted right away.
    expect(calls).toContain('Counter.incWithoutExemplar');
    const text = await metrics.registry.metrics();
    expect(text).toContain('sluice_gateway_stream_tokens_total 401');
    expect(text).toContain('sluice_inter_token_latency_seconds_count 199');
    expect(text).toContain('sluice_time_to_first_token_seconds_count 1');
    expect(text).toContain('sluice_time_to_first_token_seconds_sum 0.005');
  });

  it("counts a resumed stream's tokens without a prom-client call per write, folded in when scraped", async () => {
    const calls = spyOnPromClient();
    const metrics = createGatewayMetrics(new Registry());
    calls.length = 0;
    for (let write = 0; write < 100; write++) metrics.tokensWritten(3);
    expect(calls).toEqual([]);
    expect(await metrics.registry.metrics()).toContain('sluice_gateway_stream_tokens_total 300');
  });
});
