import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { startNginx, type NginxServer } from './support/nginx.js';
import { redisNames } from '@sluice/protocol';
import { freeze, retryMidAnswer, thaw, unfinishedInLog } from './support/mid-answer.js';
import { waitFor } from './support/processes.js';
import { scrapePrometheus, type PrometheusMetrics } from './support/prometheus.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { LiveStream, streamError } from './support/sse.js';

/**
 * The deployment's topology, natively: nginx (the deployment's proxy settings) in front of 2 gateway
 * processes, 2 worker processes and one redis-server, driven with the official `openai` client.
 */

const PROMPTS = [
  'the sea',
  'a small red fox',
  'rain on a tin roof',
  'bread',
  'winter mornings in the city',
  'a clock',
  'two old friends',
  'the moon',
  'a lighthouse',
  'an empty train station',
];
const CONCURRENT = 100;
/** Liveness fast enough that a killed worker is noticed within ~1.5 s; 3 s BullMQ locks (renewed every 1.5 s), so a starved live worker keeps its jobs. */
const WORKER_ENV = { WORKER_HEARTBEAT_MS: '250', WORKER_TTL_MS: '1500', LOCK_DURATION_MS: '3000', MAX_BATCH_SIZE: '32', LOG_LEVEL: 'info' };
const GATEWAY_ENV = { REGISTRY_POLL_MS: '200', LOG_LEVEL: 'info' };

const params = (i: number, maxTokens = 12 + (i % 5)) => ({
  model: MODEL,
  messages: [{ role: 'user' as const, content: `Tell me about ${PROMPTS[i % PROMPTS.length]}.` }],
  max_tokens: maxTokens,
  temperature: 0,
});

interface StreamResult {
  text: string;
  finishReason: string | null;
  completionTokens: number;
}

/** One streaming chat completion through the client, collected. */
async function stream(client: OpenAI, body: ReturnType<typeof params>): Promise<StreamResult> {
  const chunks = await client.chat.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let finishReason: string | null = null;
  let completionTokens = -1;
  for await (const chunk of chunks) {
    const choice = chunk.choices[0];
    if (choice !== undefined) {
      text += choice.delta.content ?? '';
      finishReason = choice.finish_reason ?? finishReason;
    }
    if (chunk.usage) completionTokens = chunk.usage.completion_tokens;
  }
  return { text, finishReason, completionTokens };
}

const sum = (values: number[]) => values.reduce((a, b) => a + b, 0);

describe('scale-out: nginx → 2 gateways → Redis → 2 workers', () => {
  let cluster: Cluster;
  let nginx: NginxServer;
  let client: OpenAI;
  const gateways: GatewayProcess[] = [];
  const workers: WorkerProcess[] = [];
  /** Each prompt's text when it runs alone, by prompt index and max_tokens. */
  const alone = new Map<string, string>();
  const key = (i: number, maxTokens = 12 + (i % 5)) => `${i % PROMPTS.length}/${maxTokens}`;

  const gatewayMetrics = () => Promise.all(gateways.map((g) => scrapePrometheus(`${g.url}/metrics`)));
  const workerMetrics = () => Promise.all(workers.map((w) => scrapePrometheus(w.healthUrl.replace('/healthz', '/metrics'))));

  beforeAll(async () => {
    cluster = await Cluster.start();
    workers.push(...(await Promise.all([cluster.worker(WORKER_ENV), cluster.worker(WORKER_ENV)])));
    gateways.push(...(await Promise.all([cluster.gateway(GATEWAY_ENV), cluster.gateway(GATEWAY_ENV)])));
    const ports = gateways.map((g) => Number(new URL(g.url).port));
    nginx = await startNginx({ upstreamPorts: ports });
    client = new OpenAI({ baseURL: `${nginx.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 30_000 });
    // Both gateways see both workers before the load starts.
    await waitFor('both workers registered with both gateways', async () => {
      const ready = await Promise.all(gateways.map((g) => g.get('/readyz')));
      return ready.every((r) => (r.body as { workers?: number }).workers === 2) ? true : undefined;
    });
  }, 120_000);

  afterAll(async () => {
    await nginx?.close();
    await cluster?.stop();
  });

  it('returns x-request-id on every reply: the client id when valid, a fresh one otherwise, and both apps log it', async () => {
    const post = (headers: Record<string, string>, body: unknown) =>
      fetch(`${nginx.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', ...headers },
        body: JSON.stringify(body),
      });

    const ok = await post({ 'X-Request-Id': 'scale-out.check-1' }, params(0));
    expect(ok.status).toBe(200);
    expect(ok.headers.get('x-request-id')).toBe('scale-out.check-1');
    await ok.text();

    const bad = await post({ 'X-Request-Id': 'not valid!' }, params(0));
    expect(bad.headers.get('x-request-id')).toMatch(/^[\w.-]{1,128}$/);
    expect(bad.headers.get('x-request-id')).not.toBe('not valid!');
    await bad.text();

    const refused = await post({ 'X-Request-Id': 'scale-out.refused' }, { model: MODEL });
    expect(refused.status).toBe(400);
    expect(refused.headers.get('x-request-id')).toBe('scale-out.refused');
    await refused.text();

    await waitFor(
      'the request id in a gateway log and a worker log',
      () => {
        const inGateway = gateways.some((g) => /"requestId":"scale-out\.check-1".*"request finished"/.test(g.process.output()));
        const inWorker = workers.some((w) => /"requestId":"scale-out\.check-1".*"request finished"/.test(w.process.output()));
        return inGateway && inWorker ? true : undefined;
      },
      5_000,
    );
  });

  it(`completes ${CONCURRENT} concurrent streams through nginx, each equal to the same request alone, served by both gateways and both workers`, async () => {
    for (let i = 0; i < PROMPTS.length * 5; i++) {
      if (alone.has(key(i))) continue;
      const reply = await client.chat.completions.create(params(i));
      alone.set(key(i), reply.choices[0]?.message.content ?? '');
    }

    const results = await Promise.all(Array.from({ length: CONCURRENT }, (_, i) => stream(client, params(i))));
    for (const [i, result] of results.entries()) {
      expect(result.text, `stream ${i}`).toBe(alone.get(key(i)));
      expect(result.finishReason).toMatch(/^(stop|length)$/);
      expect(result.completionTokens).toBeGreaterThan(0);
    }

    // Sampled answers (seeded, so they are deterministic) wander into tokens that are parts of a UTF-8
    // character, whose text the worker's detokenizer holds back: their token counts must still add up.
    const sampled = await Promise.all(
      Array.from({ length: 20 }, (_, i) => stream(client, { ...params(i, 48), temperature: 1.5, seed: i } as ReturnType<typeof params>)),
    );
    for (const result of sampled) expect(result.finishReason).toMatch(/^(stop|length)$/);

    // Every /metrics parses as Prometheus text (scrapePrometheus checks the content type and syntax).
    const [gw, wk] = await Promise.all([gatewayMetrics(), workerMetrics()]);
    for (const m of gw) expect(m.value('sluice_gateway_requests_accepted_total')).toBeGreaterThan(0);
    for (const m of wk) expect(m.value('sluice_request_success_total')).toBeGreaterThan(0);
    for (const m of gw)
      expect(m.value('sluice_gateway_requests_total', { route: '/v1/chat/completions', status: '200' })).toBeGreaterThan(0);
    for (const m of gw) expect(m.value('sluice_gateway_sse_events_total', { kind: 'done' })).toBeGreaterThan(0);
    for (const m of wk) expect(m.histogram('sluice_worker_batch_size').count).toBeGreaterThan(0);
    expect(sum(gw.map((m) => m.histogram('sluice_time_to_first_token_seconds').count))).toBe(CONCURRENT + sampled.length);
  }, 60_000);

  it('agrees across processes: tokens written == tokens generated, requests in == outcomes out', async () => {
    // Metrics settle when the last frame is written, not when the client reads it.
    let gw: PrometheusMetrics[] = [];
    let wk: PrometheusMetrics[] = [];
    await waitFor(
      'no request in flight',
      async () => {
        [gw, wk] = await Promise.all([gatewayMetrics(), workerMetrics()]);
        return sum(gw.map((m) => m.value('sluice_gateway_active_streams'))) === 0 ? true : undefined;
      },
      5_000,
    );

    const accepted = sum(gw.map((m) => m.value('sluice_gateway_requests_accepted_total')));
    const outcomes = sum(gw.map((m) => m.value('sluice_gateway_request_outcomes_total')));
    const completed = sum(
      gw.map(
        (m) =>
          m.value('sluice_gateway_request_outcomes_total', { outcome: 'stop' }) +
          m.value('sluice_gateway_request_outcomes_total', { outcome: 'length' }),
      ),
    );
    const workerOutcomes = sum(wk.map((m) => m.value('sluice_request_success_total')));
    const workerCompleted = sum(
      wk.map(
        (m) =>
          m.value('sluice_request_success_total', { finish_reason: 'stop' }) +
          m.value('sluice_request_success_total', { finish_reason: 'length' }),
      ),
    );
    expect(outcomes).toBe(accepted);
    expect(completed).toBe(accepted);
    expect(workerOutcomes).toBe(accepted);
    expect(workerCompleted).toBe(completed);

    const written = sum(gw.map((m) => m.value('sluice_gateway_stream_tokens_total')));
    const generatedForCompleted = sum(
      wk.flatMap((m) => ['stop', 'length'].map((reason) => m.histogram('sluice_request_generation_tokens', { finish_reason: reason }).sum)),
    );
    const generated = sum(wk.map((m) => m.value('sluice_generation_tokens_total')));
    expect(written).toBeGreaterThan(0);
    expect(written).toBe(generatedForCompleted);
    expect(generated).toBe(generatedForCompleted);
    expect(sum(gw.map((m) => m.value('sluice_gateway_stream_gaps_total')))).toBe(0);
  });

  it('keeps serving new requests after one of the two workers is killed with SIGKILL mid-run', async () => {
    const [doomed, survivor] = workers as [WorkerProcess, WorkerProcess];
    const [doomedId, survivorId] = await Promise.all([doomed.health(), survivor.health()]).then((h) => h.map((w) => w.workerId));
    const redis = cluster.redis.client();
    // A wave mid-run on both workers when one dies, whatever the machine's speed: both are frozen once
    // every stream is under way, and each must then hold a stream unfinished in its token log (see
    // mid-answer.ts); else they run on and a new wave tries (5 tries).
    const wave = await retryMidAnswer("a worker's last stream", async (attempt) => {
      const wave = Array.from(
        { length: 20 },
        (_, i) => new LiveStream(`${nginx.url}/v1/chat/completions`, { ...params(i + 20 * attempt, 200), stream: true }),
      );
      await Promise.all(wave.map((s) => s.until('under way', () => s.contentChunks >= 1)));
      await freeze(workers);
      const holders = await Promise.all(
        wave.map(async (s) =>
          (await unfinishedInLog(redis, s.jobId, 200)) ? await redis.hget(redisNames().metaKey(s.jobId), 'workerId') : null,
        ),
      );
      if (holders.includes(doomedId!) && holders.includes(survivorId!)) return wave;
      thaw(workers);
      for (const s of wave) s.abort();
      await Promise.all(wave.map((s) => s.ended));
      return undefined;
    });
    redis.disconnect();
    doomed.process.signal('SIGKILL');
    await doomed.process.exited;
    survivor.process.signal('SIGCONT');
    const survivorBefore = (await scrapePrometheus(survivor.healthUrl.replace('/healthz', '/metrics'))).value(
      'sluice_request_success_total',
    );

    // New requests, sent after the kill, all complete with the right text on the survivor.
    const fresh = await Promise.all(Array.from({ length: 10 }, (_, i) => stream(client, params(i))));
    for (const [i, result] of fresh.entries()) expect(result.text, `fresh stream ${i}`).toBe(alone.get(key(i)));

    // The wave ends one way or the other: whole answers, or the killed worker's streams fail cleanly.
    expect(await Promise.all(wave.map((s) => s.ended))).toEqual(wave.map(() => 'done'));
    const failed = wave.map((s) => streamError(s.items)).filter((error) => error !== undefined);
    expect(wave.length - failed.length).toBeGreaterThan(0);
    console.log(
      failed.length,
      failed.map((e) => e.code),
    );
    for (const error of failed) expect(error.message).toMatch(/worker/i);

    const served = await scrapePrometheus(survivor.healthUrl.replace('/healthz', '/metrics'));
    // The survivor finished at least the 10 fresh requests (plus whatever of the wave it held).
    expect(served.value('sluice_request_success_total') - survivorBefore).toBeGreaterThanOrEqual(fresh.length);
  }, 60_000);
});
