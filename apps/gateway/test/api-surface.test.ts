import { afterEach, describe, expect, it } from 'vitest';
import { closeAppHarnesses, startAppHarness as start, type AppHarness as Harness } from './support/app-harness.js';

afterEach(closeAppHarnesses);

function post(h: Harness, path: string, body: unknown) {
  return fetch(`${h.url}${path}`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
}

/** The JSON chunks of an SSE reply, `[DONE]` left out (asserted present). */
async function chunks(res: Response): Promise<Array<Record<string, any>>> {
  const frames = (await res.text())
    .split('\n\n')
    .filter((f) => f !== '')
    .map((f) =>
      f
        .split('\n')
        .filter((line) => line.startsWith('data: '))
        .join('')
        .slice(6),
    );
  expect(frames.at(-1)).toBe('[DONE]');
  return frames.slice(0, -1).map((f) => JSON.parse(f) as Record<string, any>);
}

describe('the endpoints peers have', () => {
  it('answers /health, /version and GET /v1/models/{id}', async () => {
    const h = await start();
    expect(await (await fetch(`${h.url}/health`)).json()).toEqual({ status: 'ok' });
    expect((await (await fetch(`${h.url}/version`)).json()) as object).toEqual({ version: expect.stringMatching(/^\d+\.\d+\.\d+/) });
    expect(await (await fetch(`${h.url}/v1/models/m`)).json()).toMatchObject({
      id: 'm',
      object: 'model',
      owned_by: 'sluice',
      max_model_len: 100,
    });
    const missing = await fetch(`${h.url}/v1/models/org/other`);
    expect(missing.status).toBe(404);
    expect(await missing.json()).toMatchObject({ error: { code: 'model_not_found', param: 'model' } });
  });

  it('answers a wrong method on a known route with 405 and Allow', async () => {
    const h = await start();
    const get = await fetch(`${h.url}/v1/chat/completions`);
    expect(get.status).toBe(405);
    expect(get.headers.get('allow')).toBe('POST');
    expect(await get.json()).toMatchObject({ error: { code: 'method_not_allowed' } });
    const del = await fetch(`${h.url}/v1/models`, { method: 'DELETE' });
    expect(del.status).toBe(405);
    expect(del.headers.get('allow')).toBe('GET, HEAD');
    expect((await fetch(`${h.url}/v1/completions/cmpl-x/cancel`)).headers.get('allow')).toBe('POST');
    expect((await fetch(`${h.url}/nowhere`, { method: 'DELETE' })).status).toBe(404);
  });
});

describe('the job a request becomes', () => {
  // A worker used to resolve the default from its own KV cache: workers of one model with different
  // MAX_CACHED_TOKENS gave one request different lengths, and a continuation on a smaller one was
  // refused mid-answer (its limit below the tokens already sent).
  it.each([
    [
      'a chat without max_tokens: the context left after the prompt',
      '/v1/chat/completions',
      { messages: [{ role: 'user', content: 'hi' }] },
      98,
    ],
    ['a completion without max_tokens: its default', '/v1/completions', { prompt: 'hi' }, 16],
    [
      'a chat with max_completion_tokens',
      '/v1/chat/completions',
      { messages: [{ role: 'user', content: 'hi' }], max_completion_tokens: 7 },
      7,
    ],
  ])('carries its completion limit resolved by the gateway: %s', async (_what, path, body, maxTokens) => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, path, { model: 'm', stream: true, ...body });
    expect((await job).sampling.maxTokens).toBe(maxTokens);
    h.send([{ type: 'rejected', error: { code: 'internal', message: 'x', param: null } }]);
    await (await reply).text();
  });
});

describe('request features peers have', () => {
  it('puts system_fingerprint on every chunk and the usage so far on every chunk with continuous_usage_stats', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', {
      model: 'm',
      messages: [{ role: 'user', content: 'hi' }],
      stream: true,
      stream_options: { include_usage: true, continuous_usage_stats: true },
    });
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    h.send([{ type: 'text-delta', index: 0, text: 'a', tokens: 1 }]);
    h.send([{ type: 'text-delta', index: 0, text: 'b', tokens: 2 }]);
    h.send([
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 3, completionTokens: 3 } },
    ]);
    const got = await chunks(await reply);
    expect(got.every((c) => /^fp_[0-9a-f]{10}$/.test(c.system_fingerprint))).toBe(true);
    expect(got.map((c) => c.usage?.completion_tokens)).toEqual([0, 1, 3, 3, 3]);
    expect(got.every((c) => c.usage.prompt_tokens === 3 && c.usage.total_tokens === 3 + c.usage.completion_tokens)).toBe(true);
    expect(got.at(-1)!.choices).toEqual([]);
  });

  it('runs a batch of prompts as one job per prompt and indexes the choices prompt × n + choice', async () => {
    const h = await start();
    const first = h.nextJob();
    const reply = post(h, '/v1/completions', { model: 'm', prompt: ['a', 'b'], n: 2, max_tokens: 2 });
    await first;
    while (h.jobs.length < 2) await new Promise((resolve) => setTimeout(resolve, 5));
    const [a, b] = h.jobs as [(typeof h.jobs)[0], (typeof h.jobs)[0]];
    expect([a.input, b.input]).toEqual([
      { kind: 'tokens', promptTokenIds: [97] },
      { kind: 'tokens', promptTokenIds: [98] },
    ]);
    expect(a.sampling.n).toBe(2);
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 1 }], b);
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 1 }], a);
    for (const [job, text] of [
      [a, 'A'],
      [b, 'B'],
    ] as const) {
      h.send(
        [
          { type: 'text-delta', index: 0, text: `${text}0`, tokens: 1 },
          { type: 'text-delta', index: 1, text: `${text}1`, tokens: 1 },
          { type: 'text-end', index: 0, finishReason: 'length' },
          { type: 'text-end', index: 1, finishReason: 'length' },
          { type: 'finish', usage: { promptTokens: 1, completionTokens: 2 } },
        ],
        job,
      );
    }
    const res = await reply;
    expect(res.status).toBe(200);
    const body = (await res.json()) as Record<string, any>;
    expect(body.choices.map((c: { index: number; text: string }) => [c.index, c.text])).toEqual([
      [0, 'A0'],
      [1, 'A1'],
      [2, 'B0'],
      [3, 'B1'],
    ]);
    expect(body.usage).toEqual({ prompt_tokens: 2, completion_tokens: 4, total_tokens: 6 });
    expect(body.id).toBe(`cmpl-${a.requestId}`);
  });

  it('fails the whole batch when one prompt is refused, and cancels the others', async () => {
    const h = await start();
    const first = h.nextJob();
    const reply = post(h, '/v1/completions', { model: 'm', prompt: ['a', 'b', 'c'] });
    await first;
    while (h.jobs.length < 3) await new Promise((resolve) => setTimeout(resolve, 5));
    h.send([{ type: 'rejected', error: { code: 'context_length_exceeded', message: 'too long', param: 'prompt' } }], h.jobs[1]);
    const res = await reply;
    expect(res.status).toBe(400);
    expect(await res.json()).toMatchObject({ error: { code: 'context_length_exceeded', param: 'prompt' } });
    expect(h.cancels.map((c) => c.requestId).sort()).toEqual([h.jobs[0]!.requestId, h.jobs[2]!.requestId].sort());
  });

  it('echoes the prompt before the completion, streamed and whole', async () => {
    const h = await start();
    for (const stream of [true, false]) {
      const job = h.nextJob();
      const reply = post(h, '/v1/completions', { model: 'm', prompt: 'Say:', echo: true, stream });
      await job;
      h.send([
        { type: 'accepted', workerId: 'w1', promptTokens: 2 },
        { type: 'text-delta', index: 0, text: ' hi', tokens: 1 },
        { type: 'text-end', index: 0, finishReason: 'stop' },
        { type: 'finish', usage: { promptTokens: 2, completionTokens: 1 } },
      ]);
      const res = await reply;
      if (stream) expect((await chunks(res)).map((c) => c.choices[0]?.text).join('')).toBe('Say: hi');
      else expect(((await res.json()) as Record<string, any>).choices[0].text).toBe('Say: hi');
    }
    // Token ids are echoed as their text (the harness's tokenizer maps a char to its code).
    const job = h.nextJob();
    const reply = post(h, '/v1/completions', { model: 'm', prompt: [[72, 105]], echo: true });
    await job;
    h.send([
      { type: 'accepted', workerId: 'w1', promptTokens: 2 },
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 2, completionTokens: 0 } },
    ]);
    expect(((await (await reply).json()) as Record<string, any>).choices[0].text).toBe('Hi');
  });

  it('gives completions logprobs with the sampled token among top_logprobs, logprobs: 0 included', async () => {
    const h = await start();
    for (const logprobs of [0, 1]) {
      const job = h.nextJob();
      const reply = post(h, '/v1/completions', { model: 'm', prompt: 'x', logprobs });
      await job;
      const top = logprobs === 0 ? [] : [{ token: 'b', logprob: -0.1 }];
      h.send([
        { type: 'accepted', workerId: 'w1', promptTokens: 1 },
        { type: 'text-delta', index: 0, text: 'a', tokens: 1, logprobs: [{ token: 'a', logprob: -0.5, top }] },
        { type: 'text-end', index: 0, finishReason: 'stop' },
        { type: 'finish', usage: { promptTokens: 1, completionTokens: 1 } },
      ]);
      const body = (await (await reply).json()) as Record<string, any>;
      expect(body.choices[0].logprobs).toEqual({
        tokens: ['a'],
        token_logprobs: [-0.5],
        top_logprobs: [logprobs === 0 ? { a: -0.5 } : { b: -0.1, a: -0.5 }],
        text_offset: [0],
      });
    }
  });

  it('counts text_offset in characters (code points) as OpenAI does, an emoji as one', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, '/v1/completions', { model: 'm', prompt: 'é', logprobs: 0 });
    await job;
    h.send([
      { type: 'accepted', workerId: 'w1', promptTokens: 1 },
      {
        type: 'text-delta',
        index: 0,
        text: '😀a',
        tokens: 2,
        logprobs: [
          { token: '😀', logprob: -0.5, top: [] },
          { token: 'a', logprob: -0.5, top: [] },
        ],
      },
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 1, completionTokens: 2 } },
    ]);
    const body = (await (await reply).json()) as Record<string, any>;
    expect(body.choices[0].text).toBe('😀a');
    // UTF-16 units would say [0, 2].
    expect(body.choices[0].logprobs.text_offset).toEqual([0, 1]);
  });

  it('writes each top_logprobs object most likely first, tokens of digits too, streamed and whole', async () => {
    const h = await start();
    for (const stream of [false, true]) {
      const job = h.nextJob();
      const reply = post(h, '/v1/completions', { model: 'm', prompt: 'x', logprobs: 3, stream });
      await job;
      const top = [
        { token: 'ian', logprob: -0.01 },
        { token: ' tw', logprob: -5.3 },
        { token: '80', logprob: -6.3 },
      ];
      h.send([
        { type: 'accepted', workerId: 'w1', promptTokens: 1 },
        { type: 'text-delta', index: 0, text: 'ian', tokens: 1, logprobs: [{ token: 'ian', logprob: -0.01, top }] },
        { type: 'text-end', index: 0, finishReason: 'stop' },
        { type: 'finish', usage: { promptTokens: 1, completionTokens: 1 } },
      ]);
      // A parsed object would list "80" first whatever the text said: the order is read off the raw text.
      expect(await (await reply).text()).toContain('"top_logprobs":[{"ian":-0.01," tw":-5.3,"80":-6.3}]');
    }
  });

  it('refuses an unsupported field with a 400 naming it', async () => {
    const h = await start();
    const res = await post(h, '/v1/chat/completions', { model: 'm', messages: [{ role: 'user', content: 'x' }], tool_choice: 'auto' });
    expect(res.status).toBe(400);
    expect(await res.json()).toMatchObject({ error: { param: 'tool_choice', type: 'invalid_request_error' } });
  });
});
