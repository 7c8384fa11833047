import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep } from './support/processes.js';
import type { GatewayProcess } from './support/sluice.js';
import { checkChunkSequence, postRaw } from './support/sse.js';

const MAX_TOKENS = 12;
const TOPICS = [
  'the sea',
  'a small red fox',
  'rain on a tin roof',
  'bread',
  'winter mornings in the city',
  'a clock',
  'two old friends',
  'the moon',
];

interface Case {
  endpoint: 'chat' | 'completion';
  body: Record<string, unknown>;
}

const cases: Case[] = TOPICS.flatMap((topic, i) => [
  {
    endpoint: 'chat' as const,
    body: {
      model: MODEL,
      messages: [{ role: 'user', content: `Tell me about ${topic}.` }],
      max_tokens: MAX_TOKENS + (i % 3),
      temperature: 0,
    },
  },
  {
    endpoint: 'completion' as const,
    body: { model: MODEL, prompt: `Once upon a time, ${topic}`, max_tokens: MAX_TOKENS - (i % 3), temperature: 0 },
  },
]);

const path = (endpoint: Case['endpoint']) => (endpoint === 'chat' ? '/v1/chat/completions' : '/v1/completions');

describe('streams through gateway, Redis and worker', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let client: OpenAI;
  /** Text of each case when it runs alone (stream: false). */
  const alone: string[] = [];

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker({ MAX_BATCH_SIZE: '16' });
    gateway = await cluster.gateway();
    client = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: 'unused', maxRetries: 0 });
  });

  afterAll(async () => {
    await cluster?.stop();
  });

  it('answers /healthz, /readyz and lists the served model in /v1/models', async () => {
    expect((await gateway.get('/healthz')).status).toBe(200);
    expect(await gateway.get('/readyz')).toMatchObject({ status: 200, body: { status: 'ready', workers: 1 } });
    const models = await client.models.list();
    expect(models.data.map((m) => m.id)).toEqual([MODEL]);
  });

  it('returns a complete object for stream: false, the same text as the stream', async () => {
    for (const c of cases) {
      const res = await postRaw(`${gateway.url}${path(c.endpoint)}`, c.body);
      expect(res.status).toBe(200);
      // Where its time went, as the gateway saw it: admitted, queued until a worker accepted, generated.
      expect(res.headers.get('server-timing')).toMatch(/^admit;dur=[\d.]+, queue;dur=[\d.]+, generate;dur=[\d.]+$/);
      const json = res.json as {
        object: string;
        choices: Array<{ message?: { role: string; content: string }; text?: string; finish_reason: string }>;
        usage: { prompt_tokens: number; completion_tokens: number; total_tokens: number };
      };
      expect(json.object).toBe(c.endpoint === 'chat' ? 'chat.completion' : 'text_completion');
      const choice = json.choices[0];
      const text = c.endpoint === 'chat' ? choice?.message?.content : choice?.text;
      expect(typeof text).toBe('string');
      expect(json.usage.total_tokens).toBe(json.usage.prompt_tokens + json.usage.completion_tokens);
      expect(json.usage.completion_tokens).toBeLessThanOrEqual(c.body.max_tokens as number);
      alone.push(text ?? '');
    }
    // The same request streamed alone gives the same text.
    const first = cases[0]!;
    const streamed = await postRaw(`${gateway.url}${path(first.endpoint)}`, { ...first.body, stream: true });
    expect(checkChunkSequence(streamed.items, first.endpoint, false).text).toBe(alone[0]);
  });

  it('streams 64 concurrent requests with staggered starts, each equal to the same request alone', async () => {
    expect(alone).toHaveLength(cases.length);
    const runs = Array.from({ length: 64 }, async (_, i) => {
      const caseIndex = i % cases.length;
      const c = cases[caseIndex]!;
      const includeUsage = i % 2 === 0;
      await sleep((i % 16) * 15);
      if (i % 4 < 2) {
        // Raw fetch: the exact chunk sequence and headers.
        const res = await postRaw(`${gateway.url}${path(c.endpoint)}`, {
          ...c.body,
          stream: true,
          ...(includeUsage ? { stream_options: { include_usage: true } } : {}),
        });
        expect(res.status).toBe(200);
        expect(res.headers.get('content-type')).toMatch(/^text\/event-stream/);
        expect(res.headers.get('cache-control')).toBe('no-cache');
        expect(res.headers.get('x-accel-buffering')).toBe('no');
        // `queue` only when a worker accepted it within HEADERS_WAIT_MS (the headers go out then, or at its end).
        expect(res.headers.get('server-timing')).toMatch(/^admit;dur=[\d.]+(, queue;dur=[\d.]+)?$/);
        const checked = checkChunkSequence(res.items, c.endpoint, includeUsage);
        if (includeUsage) expect(checked.usage?.completion_tokens).toBeGreaterThan(0);
        return { caseIndex, text: checked.text };
      }
      // The official client.
      let text = '';
      let usage: unknown;
      if (c.endpoint === 'chat') {
        const stream = await client.chat.completions.create({
          ...(c.body as { model: string; messages: Array<{ role: 'user'; content: string }>; max_tokens: number }),
          stream: true,
          ...(includeUsage ? { stream_options: { include_usage: true } } : {}),
        });
        for await (const chunk of stream) {
          text += chunk.choices[0]?.delta.content ?? '';
          if (chunk.usage) usage = chunk.usage;
        }
      } else {
        const stream = await client.completions.create({
          ...(c.body as { model: string; prompt: string; max_tokens: number }),
          stream: true,
          ...(includeUsage ? { stream_options: { include_usage: true } } : {}),
        });
        for await (const chunk of stream) {
          text += chunk.choices[0]?.text ?? '';
          if (chunk.usage) usage = chunk.usage;
        }
      }
      if (includeUsage) expect(usage).toMatchObject({ completion_tokens: expect.any(Number) });
      return { caseIndex, text };
    });
    const results = await Promise.all(runs);
    for (const { caseIndex, text } of results) expect(text, `case ${caseIndex}`).toBe(alone[caseIndex]);
  });

  it("counts every prompt of a batch in each chunk's continuous usage, as the final usage does", async () => {
    const prompts = ['Hello', 'a b c d e f'];
    const counts = await Promise.all(
      prompts.map(async (prompt) => {
        const res = await postRaw(`${gateway.url}/tokenize`, { model: MODEL, prompt });
        return (res.json as { count: number }).count;
      }),
    );
    const promptTokens = counts.reduce((sum, count) => sum + count, 0);
    expect(counts[0]).not.toBe(counts[1]);
    const streamed = await postRaw(`${gateway.url}/v1/completions`, {
      model: MODEL,
      prompt: prompts,
      n: 2,
      max_tokens: 2,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true, continuous_usage_stats: true },
    });
    const chunks = streamed.items.flatMap((item) =>
      item.kind === 'data' && item.data !== '[DONE]'
        ? [JSON.parse(item.data) as { choices: unknown[]; usage: { prompt_tokens: number } }]
        : [],
    );
    const final = chunks.at(-1)!;
    expect(final.choices).toEqual([]);
    expect(final.usage.prompt_tokens).toBe(promptTokens);
    expect(chunks.length).toBeGreaterThan(1);
    for (const chunk of chunks) expect(chunk.usage.prompt_tokens).toBe(promptTokens);
  });
});
