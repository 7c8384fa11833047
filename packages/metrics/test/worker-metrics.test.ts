import { describe, expect, it } from 'vitest';
import { parsePrometheusText, type PrometheusMetrics } from '../../../test/support/prometheus.js';
import {
  QUEUE_JOB_STATES,
  Registry,
  createGatewayMetrics,
  createWorkerMetrics,
  type EngineStepStats,
  type WorkerMetrics,
} from '../src/index.js';

function setup(): { metrics: WorkerMetrics; scrape: () => Promise<PrometheusMetrics> } {
  const metrics = createWorkerMetrics();
  return { metrics, scrape: async () => parsePrometheusText(await metrics.registry.metrics()) };
}

function step(overrides: Partial<EngineStepStats>): EngineStepStats {
  return {
    phase: 'decode',
    batchSize: 1,
    stepTokens: 1,
    stepMs: 10,
    modelMs: 8,
    running: 1,
    waiting: 0,
    cachedTokens: 0,
    maxCachedTokens: 1000,
    promptTokens: 0,
    generationTokens: 1,
    ...overrides,
  };
}

describe('createWorkerMetrics', () => {
  it('includes the default process metrics and documents every metric', async () => {
    const { scrape } = setup();
    const scraped = await scrape();
    expect(scraped.family('process_resident_memory_bytes').type).toBe('gauge');
    for (const family of scraped.families.values()) expect(family.help, family.name).not.toBe('');
  });

  it('shares one registry with the gateway metrics, with one set of process metrics', async () => {
    const registry = new Registry();
    createGatewayMetrics(registry);
    createWorkerMetrics(registry);
    const scraped = parsePrometheusText(await registry.metrics());
    expect(scraped.has('sluice_gateway_active_streams')).toBe(true);
    expect(scraped.has('sluice_num_requests_running')).toBe(true);
    expect(scraped.family('process_cpu_seconds_total').samples).toHaveLength(1);
  });

  it("feeds the host thread's event-loop delay and Node's lag gauges from one window, measured while jobs run", async () => {
    const metrics = createWorkerMetrics();
    const scrape = async () => parsePrometheusText(await metrics.scrape());
    const host = (scraped: PrometheusMetrics, quantile: string) =>
      scraped.family('sluice_worker_host_event_loop_lag_seconds').samples.find((s) => s.labels['quantile'] === quantile)?.value;
    const idle = await scrape();
    expect(host(idle, '1')).toBe(0);
    expect(idle.value('nodejs_eventloop_lag_max_seconds')).toBe(0);
    const end = metrics.eventLoopDelay.begin();
    await new Promise((resolve) => setTimeout(resolve, 60));
    end();
    const busy = await scrape();
    expect(host(busy, '0.5')).toBe(busy.value('nodejs_eventloop_lag_p50_seconds'));
    expect(host(busy, '0.99')).toBe(busy.value('nodejs_eventloop_lag_p99_seconds'));
    expect(host(busy, '1')).toBe(busy.value('nodejs_eventloop_lag_max_seconds'));
    expect(host(busy, '1')).toBeGreaterThanOrEqual(0.009);
  });

  it('shows every phase, finish reason and queue state from the first scrape', async () => {
    const scraped = await setup().scrape();
    expect(scraped.family('sluice_worker_step_seconds').histograms.map((h) => h.labels['phase'])).toEqual(['prefill', 'decode', 'mixed']);
    expect(scraped.family('sluice_request_success_total').samples.map((s) => s.labels['finish_reason'])).toEqual([
      'stop',
      'length',
      'abort',
      'error',
    ]);
    expect(scraped.family('sluice_worker_queue_jobs').samples.map((s) => s.labels['state'])).toEqual([...QUEUE_JOB_STATES]);
  });

  describe('observeStep', () => {
    it('records batch size, step tokens and step and model time by phase', async () => {
      const { metrics, scrape } = setup();
      metrics.observeStep(
        step({ phase: 'prefill', batchSize: 2, stepTokens: 40, stepMs: 30, modelMs: 25, promptTokens: 40, generationTokens: 2 }),
      );
      metrics.observeStep(step({ phase: 'decode', batchSize: 2, stepTokens: 2, stepMs: 4, modelMs: 3, generationTokens: 2 }));
      metrics.observeStep(
        step({ phase: 'mixed', batchSize: 3, stepTokens: 17, stepMs: 12, modelMs: 9, promptTokens: 15, generationTokens: 3 }),
      );
      const scraped = await scrape();

      const batch = scraped.histogram('sluice_worker_batch_size');
      expect(batch.count).toBe(3);
      expect(batch.sum).toBe(7);
      expect(batch.buckets.find((b) => b.le === 2)?.count).toBe(2);
      expect(scraped.histogram('sluice_worker_step_tokens').sum).toBe(59);

      expect(scraped.histogram('sluice_worker_step_seconds', { phase: 'prefill' }).sum).toBeCloseTo(0.03, 9);
      expect(scraped.histogram('sluice_worker_step_seconds', { phase: 'decode' }).sum).toBeCloseTo(0.004, 9);
      expect(scraped.histogram('sluice_worker_step_seconds').count).toBe(3);
      const decodeRun = scraped.histogram('sluice_worker_model_run_seconds', { phase: 'decode' });
      expect(decodeRun.sum).toBeCloseTo(0.003, 9);
      expect(decodeRun.buckets.find((b) => b.le === 0.002)?.count).toBe(0);
      expect(decodeRun.buckets.find((b) => b.le === 0.003)?.count).toBe(1);
      expect(scraped.histogram('sluice_worker_model_run_seconds', { phase: 'mixed' }).sum).toBeCloseTo(0.009, 9);

      expect(scraped.value('sluice_prompt_tokens_total')).toBe(55);
      expect(scraped.value('sluice_generation_tokens_total')).toBe(7);
      expect(scraped.value('sluice_kv_cache_relayouts_total')).toBe(0);
      metrics.observeStep(step({ kvRelayouts: 2 }));
      metrics.observeStep(step({ kvRelayouts: 1 }));
      expect((await scrape()).value('sluice_kv_cache_relayouts_total')).toBe(3);
    });

    it('sets running, waiting and KV cache usage from the latest step', async () => {
      const { metrics, scrape } = setup();
      metrics.observeStep(step({ running: 5, waiting: 9, cachedTokens: 100, maxCachedTokens: 400 }));
      metrics.observeStep(step({ running: 4, waiting: 2, cachedTokens: 300, maxCachedTokens: 400 }));
      const scraped = await scrape();
      expect(scraped.value('sluice_num_requests_running')).toBe(4);
      expect(scraped.value('sluice_num_requests_waiting')).toBe(2);
      expect(scraped.value('sluice_kv_cache_usage_perc')).toBe(0.75);
    });

    it('reports zero KV usage when the engine has no budget', async () => {
      const { metrics, scrape } = setup();
      metrics.observeStep(step({ cachedTokens: 0, maxCachedTokens: 0 }));
      expect((await scrape()).value('sluice_kv_cache_usage_perc')).toBe(0);
    });
  });

  describe('observeRequestFinished', () => {
    it('counts outcomes by finish reason and records lengths and engine timings', async () => {
      const { metrics, scrape } = setup();
      const timings = { queueMs: 20, prefillMs: 50 };
      metrics.observeRequestFinished({ finishReason: 'stop', usage: { promptTokens: 12, completionTokens: 30 }, timings });
      metrics.observeRequestFinished({ finishReason: 'length', usage: { promptTokens: 8, completionTokens: 16 }, timings });
      metrics.observeRequestFinished({
        finishReason: 'abort',
        usage: { promptTokens: 5, completionTokens: 0 },
        timings: { queueMs: 3000, prefillMs: 0 },
      });
      metrics.observeRequestFinished({ finishReason: 'error', usage: { promptTokens: 5, completionTokens: 0 } });
      const scraped = await scrape();

      expect(scraped.value('sluice_request_success_total', { finish_reason: 'stop' })).toBe(1);
      expect(scraped.value('sluice_request_success_total')).toBe(4);
      expect(scraped.histogram('sluice_request_prompt_tokens').sum).toBe(30);
      expect(scraped.histogram('sluice_request_generation_tokens', { finish_reason: 'stop' }).sum).toBe(30);
      expect(scraped.histogram('sluice_request_generation_tokens', { finish_reason: 'length' }).sum).toBe(16);
      expect(scraped.histogram('sluice_request_generation_tokens').count).toBe(4);
      const queue = scraped.histogram('sluice_worker_engine_queue_time_seconds');
      expect(queue.count).toBe(3);
      expect(queue.sum).toBeCloseTo(3.04, 9);
      // Only requests that produced a token completed a prefill.
      const prefill = scraped.histogram('sluice_request_prefill_time_seconds');
      expect(prefill.count).toBe(2);
      expect(prefill.sum).toBeCloseTo(0.1, 9);
    });
  });

  describe('queue depth', () => {
    it('keeps states left out of an update', async () => {
      const { metrics, scrape } = setup();
      metrics.setQueueDepth({ waiting: 7, active: 2, delayed: 1, failed: 4 });
      metrics.setQueueDepth({ waiting: 3 });
      const scraped = await scrape();
      expect(scraped.value('sluice_worker_queue_jobs', { state: 'waiting' })).toBe(3);
      expect(scraped.value('sluice_worker_queue_jobs', { state: 'active' })).toBe(2);
      expect(scraped.value('sluice_worker_queue_jobs', { state: 'failed' })).toBe(4);
    });

    it('reads a source at every scrape', async () => {
      const { metrics, scrape } = setup();
      let waiting = 0;
      metrics.setQueueDepthSource(async () => ({ waiting: ++waiting, active: 1, delayed: 0, failed: 0 }));
      expect((await scrape()).value('sluice_worker_queue_jobs', { state: 'waiting' })).toBe(1);
      expect((await scrape()).value('sluice_worker_queue_jobs', { state: 'waiting' })).toBe(2);
      metrics.setQueueDepthSource(undefined);
      expect((await scrape()).value('sluice_worker_queue_jobs', { state: 'waiting' })).toBe(2);
    });

    it('keeps the last values when the source fails or hangs, without failing the scrape', async () => {
      const { metrics, scrape } = setup();
      metrics.setQueueDepth({ waiting: 5 });
      metrics.setQueueDepthSource(() => Promise.reject(new Error('redis is down')));
      expect((await scrape()).value('sluice_worker_queue_jobs', { state: 'waiting' })).toBe(5);
      metrics.setQueueDepthSource(() => new Promise(() => {}), 50);
      const started = performance.now();
      expect((await scrape()).value('sluice_worker_queue_jobs', { state: 'waiting' })).toBe(5);
      expect(performance.now() - started).toBeLessThan(5000);
    });
  });

  it('records the engine thread event-loop lag in seconds', async () => {
    const { metrics, scrape } = setup();
    metrics.setEngineEventLoopLag(42);
    expect((await scrape()).value('sluice_worker_engine_event_loop_lag_seconds')).toBe(0.042);
  });
});
