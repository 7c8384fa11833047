import { afterEach, describe, expect, it, vi } from 'vitest';
import { pino } from 'pino';
import { createGatewayMetrics } from '@sluice/metrics';
import { spyOnPromClient } from '../../../test/support/prom-client-spy.js';
import { createGatewayObserver } from '../src/gateway-observer.js';
import { closeAppHarnesses, startAppHarness as start, type AppHarness as Harness } from './support/app-harness.js';

afterEach(closeAppHarnesses);

const chatBody = (extra: Record<string, unknown> = {}) =>
  JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true, ...extra });

function post(h: Harness, body: string, headers: Record<string, string> = {}, signal?: AbortSignal) {
  return fetch(`${h.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...headers },
    body,
    ...(signal ? { signal } : {}),
  });
}

/** Lets the server see a closed connection or a finished response. */
const settle = () => new Promise((resolve) => setTimeout(resolve, 50));

describe('gateway metrics as the app records them', () => {
  it('counts a whole stream: request, frames and bytes as written, tokens (held-back ones included), TTFT and its outcome', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, chatBody());
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    h.send([{ type: 'text-delta', index: 0, text: 'Hel', tokens: 1 }]);
    h.send([
      { type: 'text-delta', index: 0, text: 'lo', tokens: 2 },
      // Tokens whose text the worker's detokenizer never released: counted, nothing written.
      { type: 'text-delta', index: 0, text: '', tokens: 1 },
      { type: 'text-end', index: 0, finishReason: 'length' },
      { type: 'finish', usage: { promptTokens: 3, completionTokens: 4 } },
    ]);
    const body = await (await reply).text();
    await settle();
    const frames = body.split('\n\n').filter((f) => f !== '');
    expect(await h.value('sluice_gateway_sse_events_total')).toBe(frames.length);
    expect(await h.value('sluice_gateway_sse_events_total', { kind: 'done' })).toBe(1);
    expect(await h.value('sluice_gateway_sse_bytes_total')).toBe(Buffer.byteLength(body));
    expect(await h.value('sluice_gateway_stream_tokens_total')).toBe(4);
    expect(await h.value('sluice_gateway_requests_accepted_total')).toBe(1);
    expect(await h.value('sluice_gateway_request_outcomes_total', { outcome: 'length' })).toBe(1);
    expect(await h.value('sluice_gateway_requests_total', { route: '/v1/chat/completions', status: '200' })).toBe(1);
    expect(await h.value('sluice_gateway_active_streams')).toBe(0);
    expect((await h.metrics.timeToFirstToken.get()).values.find((v) => v.metricName?.endsWith('_count'))?.value).toBe(1);
  });

  it("exposes every refusal reason, stream error code and the completion routes' statuses at zero before any request", async () => {
    const h = await start();
    const text = await (await fetch(`${h.url}/metrics`)).text();
    for (const series of [
      'sluice_gateway_rejected_total{reason="shutting_down"} 0',
      'sluice_gateway_rejected_total{reason="store_unavailable"} 0',
      'sluice_gateway_rejected_total{reason="no_workers"} 0',
      'sluice_gateway_stream_errors_total{code="worker_lost"} 0',
      'sluice_gateway_requests_total{route="/v1/chat/completions",status="503"} 0',
      'sluice_gateway_requests_total{route="/v1/completions",status="500"} 0',
      'sluice_gateway_requests_total{route="/v1/completions",status="200"} 0',
    ]) {
      expect(text.split('\n')).toContain(series);
    }
  });

  it('counts the bytes of text outside ASCII as written (UTF-8)', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, chatBody());
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    h.send([
      { type: 'text-delta', index: 0, text: 'ÿé', tokens: 1 },
      { type: 'text-delta', index: 0, text: ' plain', tokens: 1 },
      { type: 'text-delta', index: 0, text: '🙂', tokens: 1 },
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 3, completionTokens: 3 } },
    ]);
    const body = Buffer.from(await (await reply).arrayBuffer());
    await settle();
    expect(body.toString('utf8')).toContain('"content":"ÿé"');
    expect(await h.value('sluice_gateway_sse_bytes_total')).toBe(body.length);
  });

  it('times inter-token gaps per step: n = 3 choices, one chunk each per step, add no zero gaps', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, chatBody({ n: 3 }));
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    for (let step = 0; step < 6; step++) {
      h.send([0, 1, 2].map((index) => ({ type: 'text-delta' as const, index, text: 'x', tokens: 1 })));
      await settle();
    }
    h.send([
      ...[0, 1, 2].map((index) => ({ type: 'text-end' as const, index, finishReason: 'length' as const })),
      { type: 'finish', usage: { promptTokens: 3, completionTokens: 18 } },
    ]);
    await (await reply).text();
    await settle();
    const count = async (histogram: { get(): Promise<{ values: Array<{ metricName?: string; value: number }> }> }) =>
      (await histogram.get()).values.find((v) => v.metricName?.endsWith('_count'))?.value;
    expect(await count(h.metrics.timeToFirstToken)).toBe(1);
    expect(await count(h.metrics.interTokenLatency)).toBe(5);
    expect(await h.value('sluice_gateway_stream_tokens_total')).toBe(18);
  });

  it('calls no prom-client method while content is written: tokens, TTFT and ITL are folded in when scraped', async () => {
    const calls = spyOnPromClient();
    try {
      const callsFor = async (steps: number) => {
        const h = await start();
        const job = h.nextJob();
        const reply = post(h, chatBody());
        await job;
        h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
        const before = calls.length;
        for (let i = 0; i < steps; i++) h.send([{ type: 'text-delta', index: 0, text: 'x', tokens: 1 }]);
        const during = calls.slice(before);
        h.send([
          { type: 'text-end', index: 0, finishReason: 'length' },
          { type: 'finish', usage: { promptTokens: 3, completionTokens: steps } },
        ]);
        await (await reply).text();
        await settle();
        expect(await h.value('sluice_gateway_stream_tokens_total')).toBe(steps);
        return during;
      };
      expect(await callsFor(50)).toEqual([]);
      expect(await callsFor(1)).toEqual([]);
    } finally {
      vi.restoreAllMocks();
    }
  });

  it('counts a stream a draining gateway left for a resume as detached, not as an error (its error frame is counted)', async () => {
    const metrics = createGatewayMetrics();
    const hooks = createGatewayObserver(metrics, pino({ level: 'silent' }));
    const observer = hooks.requestStarted!({
      requestId: 'r',
      jobId: 'j',
      endpoint: 'chat',
      model: 'm',
      stream: true,
      receivedAt: performance.now(),
    });
    observer.accepted();
    observer.finished({
      end: { outcome: 'error', code: 'shutting_down', detached: true },
      status: 200,
      promptTokens: 1,
      completionTokens: 2,
    });
    const value = async (name: string, labels: Record<string, string>) =>
      (await metrics.registry.getSingleMetric(name)!.get()).values.find((v) =>
        Object.entries(labels).every(([k, want]) => String((v.labels as Record<string, unknown>)[k]) === want),
      )?.value;
    expect(await value('sluice_gateway_request_outcomes_total', { outcome: 'detached' })).toBe(1);
    expect(await value('sluice_gateway_request_outcomes_total', { outcome: 'error' })).toBe(0);
    expect(await value('sluice_gateway_stream_errors_total', { code: 'shutting_down' })).toBe(1);
  });

  it("logs the gateway's side of the TTFT breakdown when a request ends: prompt ready, enqueued, accepted, first token, in order", async () => {
    const lines: Array<Record<string, unknown>> = [];
    const logger = pino({ level: 'info' }, { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) });
    const hooks = createGatewayObserver(createGatewayMetrics(), logger);
    const receivedAt = performance.now();
    const observer = hooks.requestStarted!({ requestId: 'r', jobId: 'j', endpoint: 'chat', model: 'm', stream: true, receivedAt });
    observer.enqueued?.();
    observer.accepted();
    observer.contentWritten(0);
    observer.contentWritten(1);
    observer.contentWritten(1);
    observer.finished({ end: { outcome: 'length' }, status: 200, promptTokens: 1, completionTokens: 2 });
    const t = lines.find((l) => l['msg'] === 'request finished')?.['timing'] as Record<string, number>;
    expect(Math.abs(t['receivedAt']! - (performance.timeOrigin + receivedAt))).toBeLessThan(0.01);
    expect(0).toBeLessThanOrEqual(t['preparedMs']!);
    expect(t['preparedMs']).toBeLessThanOrEqual(t['enqueuedMs']!);
    expect(t['enqueuedMs']).toBeLessThanOrEqual(t['acceptedMs']!);
    expect(t['acceptedMs']).toBeLessThanOrEqual(t['firstTokenMs']!);
  });

  it.each([
    ['queued', 0],
    ['prefill', 1],
    ['decode', 2],
  ] as const)('counts a client that leaves while its request is %s', async (stage, progress) => {
    const h = await start({ HEADERS_WAIT_MS: '0' });
    const controller = new AbortController();
    const job = h.nextJob();
    const reply = post(h, chatBody(), {}, controller.signal);
    await job;
    const res = await reply;
    if (progress >= 1) h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }, { type: 'scheduled' }]);
    if (progress >= 2) h.send([{ type: 'text-delta', index: 0, text: 'a', tokens: 1 }]);
    await settle();
    controller.abort();
    await res.text().catch(() => undefined);
    await settle();
    expect(await h.value('sluice_gateway_disconnects_total', { stage })).toBe(1);
    expect(await h.value('sluice_gateway_disconnects_total')).toBe(1);
    expect(await h.value('sluice_gateway_request_outcomes_total', { outcome: 'disconnect' })).toBe(1);
  });

  it('counts a 429 as a refusal by reason and by status, and returns the request id with it', async () => {
    const h = await start({ MAX_QUEUED_REQUESTS: '1' });
    const first = h.nextJob();
    const waiting = post(h, chatBody());
    await first;
    const refused = await post(h, chatBody(), { 'X-Request-Id': 'client-42' });
    expect(refused.status).toBe(429);
    expect(refused.headers.get('x-request-id')).toBe('client-42');
    await refused.text();
    await settle();
    expect(await h.value('sluice_gateway_rejected_total', { reason: 'queue_full' })).toBe(1);
    expect(await h.value('sluice_gateway_requests_total', { status: '429' })).toBe(1);
    expect(await h.value('sluice_gateway_requests_accepted_total')).toBe(1);
    h.send([{ type: 'rejected', error: { code: 'internal', message: 'x', param: null } }]);
    await (await waiting).text();
  });

  it('counts an idle timeout by kind and a sequence gap', async () => {
    const h = await start({ IDLE_TIMEOUT_MS: '100', HEADERS_WAIT_MS: '0' });
    let job = h.nextJob();
    let reply = post(h, chatBody());
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }, { type: 'scheduled' }]);
    await (await reply).text();
    expect(await h.value('sluice_gateway_timeouts_total', { kind: 'idle' })).toBe(1);
    expect(await h.value('sluice_gateway_request_outcomes_total', { outcome: 'timeout' })).toBe(1);

    job = h.nextJob();
    reply = post(h, chatBody());
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    h.send([{ seq: 5, type: 'text-delta', index: 0, text: 'x', tokens: 1 }]);
    await (await reply).text();
    expect(await h.value('sluice_gateway_stream_gaps_total')).toBe(1);
    expect(await h.value('sluice_gateway_stream_errors_total', { code: 'stream_interrupted' })).toBe(1);
  });

  it('takes a valid X-Request-Id for the reply and the job, replaces an invalid one, and keeps job ids unique', async () => {
    const h = await start({ HEADERS_WAIT_MS: '0' });
    const ids: string[] = [];
    for (const header of ['same-id', 'same-id', 'bad id!']) {
      const job = h.nextJob();
      const reply = post(h, chatBody(), { 'X-Request-Id': header });
      const sent = await job;
      const res = await reply;
      const id = res.headers.get('x-request-id') ?? '';
      expect(sent.correlationId).toBe(id);
      if (header === 'bad id!') expect(id).toMatch(/^[0-9a-f-]{36}$/);
      else expect(id).toBe(header);
      ids.push(sent.requestId);
      h.send([{ type: 'rejected', error: { code: 'internal', message: 'x', param: null } }]);
      await res.text();
    }
    expect(new Set(ids).size).toBe(3);
    const notFound = await fetch(`${h.url}/nope`, { headers: { 'X-Request-Id': 'nf-1' } });
    expect(notFound.headers.get('x-request-id')).toBe('nf-1');
    const metricsReply = await fetch(`${h.url}/metrics`);
    expect(metricsReply.headers.get('x-request-id')).toMatch(/^[\w.-]+$/);
  });
});
