import { afterEach, describe, expect, it } from 'vitest';
import { closeAppHarnesses, startAppHarness as start, type AppHarness as Harness } from './support/app-harness.js';

afterEach(closeAppHarnesses);

/** The SSE events of a reply: their `id:` (if any) and their other lines. */
async function readEvents(res: Response): Promise<Array<{ id: string | undefined; frame: string }>> {
  const text = await res.text();
  return text
    .split('\n\n')
    .filter((event) => event !== '')
    .map((event) => {
      const lines = event.split('\n');
      const id = lines.find((line) => line.startsWith('id: '))?.slice(4);
      return { id, frame: lines.filter((line) => !line.startsWith('id: ')).join('\n') };
    });
}

async function readAll(res: Response): Promise<string[]> {
  return (await readEvents(res)).map((event) => event.frame);
}

const chatBody = (extra: Record<string, unknown> = {}) =>
  JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true, ...extra });

function post(h: Harness, path: string, body: string, signal?: AbortSignal) {
  return fetch(`${h.url}${path}`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body, ...(signal ? { signal } : {}) });
}

describe('the SSE stream path', () => {
  it('writes the role chunk, content chunks, finish chunk, usage chunk and [DONE]', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', chatBody({ stream_options: { include_usage: true } }));
    expect((await job).channel).toBe('test-channel');
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    h.send([{ type: 'text-delta', index: 0, text: 'Hel', tokens: 1 }]);
    h.send([
      { type: 'text-delta', index: 0, text: 'lo', tokens: 1 },
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 3, completionTokens: 2 } },
    ]);
    const res = await reply;
    expect(res.headers.get('content-type')).toBe('text/event-stream; charset=utf-8');
    const events = await readEvents(res);
    // Each event's id is the cursor of the last entry it completes; [DONE] needs none.
    expect(events.map((e) => e.id)).toEqual(['0', '1', '2', '3', '4', undefined]);
    const frames = events.map((e) => e.frame);
    expect(frames.at(-1)).toBe('data: [DONE]');
    const chunks = frames.slice(0, -1).map((f) => JSON.parse(f.replace(/^data: /, '')) as Record<string, any>);
    expect(chunks.map((c) => c.choices[0]?.delta ?? null)).toEqual([
      { role: 'assistant', content: '' },
      { content: 'Hel' },
      { content: 'lo' },
      {},
      null,
    ]);
    expect(chunks[3]!.choices[0].finish_reason).toBe('stop');
    expect(chunks.slice(0, 4).every((c) => c.usage === null)).toBe(true);
    expect(chunks[4]).toMatchObject({ choices: [], usage: { prompt_tokens: 3, completion_tokens: 2, total_tokens: 5 } });
  });

  it('writes text as UTF-8 whatever its characters (ASCII frames take a faster path)', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', chatBody());
    await job;
    // Latin-1-range characters are the ones a one-byte encoding would get wrong.
    const texts = ['plain', 'ÿ', 'é', '🙂', 'tab\t"quote"\\ \u0001', 'mixed ü and ascii'];
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    h.send(texts.map((text) => ({ type: 'text-delta' as const, index: 0, text, tokens: 1 })));
    h.send([
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 3, completionTokens: texts.length } },
    ]);
    const frames = await readAll(await reply);
    const contents = frames
      .slice(1, 1 + texts.length)
      .map((f) => (JSON.parse(f.replace(/^data: /, '')) as { choices: Array<{ delta: { content: string } }> }).choices[0]!.delta.content);
    expect(contents).toEqual(texts);
  });

  it("tells where the request's time went in a Server-Timing header: admit and queue on a stream, generate too on a complete reply", async () => {
    const h = await start();
    const dur = (header: string | null, name: string) => Number(new RegExp(`(?:^|, )${name};dur=([\\d.]+)`).exec(header ?? '')?.[1]);
    let job = h.nextJob();
    const stream = post(h, '/v1/chat/completions', chatBody());
    await job;
    await new Promise((resolve) => setTimeout(resolve, 30));
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    const streamed = await stream;
    const streamTiming = streamed.headers.get('server-timing');
    expect(streamTiming).toMatch(/^admit;dur=[\d.]+, queue;dur=[\d.]+$/);
    // The queue span holds the 30 ms the test kept the worker's accept back.
    expect(dur(streamTiming, 'queue')).toBeGreaterThanOrEqual(25);
    h.send([
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 3, completionTokens: 0 } },
    ]);
    await streamed.text();

    job = h.nextJob();
    const complete = post(h, '/v1/chat/completions', chatBody({ stream: false }));
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    await new Promise((resolve) => setTimeout(resolve, 30));
    h.send([
      { type: 'text-delta', index: 0, text: 'hi', tokens: 1 },
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 3, completionTokens: 1 } },
    ]);
    const timing = (await complete).headers.get('server-timing');
    expect(timing).toMatch(/^admit;dur=[\d.]+, queue;dur=[\d.]+, generate;dur=[\d.]+$/);
    expect(dur(timing, 'generate')).toBeGreaterThanOrEqual(25);
  });

  it('sends only the admit span on a stream whose headers go out before a worker accepts', async () => {
    const h = await start({ HEADERS_WAIT_MS: '0' });
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', chatBody());
    await job;
    const res = await reply;
    expect(res.headers.get('server-timing')).toMatch(/^admit;dur=[\d.]+$/);
    h.send([{ type: 'error', error: { code: 'internal', message: 'x', param: null } }]);
    await res.text();
  });

  it('ends the stream with an error frame when a sequence gap cannot be repaired from the token log', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', chatBody());
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 3 }]);
    h.send([{ type: 'text-delta', index: 0, text: 'a', tokens: 1 }]);
    h.send([{ seq: 3, type: 'text-delta', index: 0, text: 'c', tokens: 1 }]);
    const frames = await readAll(await reply);
    expect(frames.slice(-2)).toEqual([expect.stringContaining('"code":"stream_interrupted"'), 'data: [DONE]']);
    expect(h.cancels).toEqual([{ requestId: (await job).requestId, reason: 'stream_failed', wasQueued: false }]);
  });

  it('writes deltas arriving within STREAM_INTERVAL_MS as one chunk', async () => {
    const h = await start({ STREAM_INTERVAL_MS: '100' });
    const job = h.nextJob();
    const reply = post(h, '/v1/completions', JSON.stringify({ model: 'm', prompt: 'x', stream: true }));
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 1 }]);
    for (const text of ['a', 'b', 'c', 'd']) h.send([{ type: 'text-delta', index: 0, text, tokens: 1 }]);
    await new Promise((resolve) => setTimeout(resolve, 150));
    h.send([
      { type: 'text-delta', index: 0, text: 'e', tokens: 1 },
      { type: 'text-end', index: 0, finishReason: 'length' },
      { type: 'finish', usage: { promptTokens: 1, completionTokens: 5 } },
    ]);
    const frames = await readAll(await reply);
    const texts = frames
      .slice(0, -1)
      .map((f) => (JSON.parse(f.replace(/^data: /, '')) as { choices: Array<{ text: string }> }).choices[0]!.text);
    // The first delta goes out at once, the next three together at the end of the window, then 'e', then the finish chunk.
    expect(texts).toEqual(['a', 'bcd', 'e', '']);
  });

  it('sends ": ping" while nothing else is sent, before a worker accepts', async () => {
    const h = await start({ HEARTBEAT_MS: '50', HEADERS_WAIT_MS: '0' });
    const job = h.nextJob();
    const controller = new AbortController();
    const res = await post(h, '/v1/chat/completions', chatBody(), controller.signal);
    expect(res.status).toBe(200);
    await job;
    const reader = res.body!.getReader();
    let text = '';
    const until = Date.now() + 400;
    while (Date.now() < until) {
      const { value } = await reader.read();
      text += new TextDecoder().decode(value);
    }
    expect(text.split(': ping\n\n').length - 1).toBeGreaterThanOrEqual(4);
    expect(text).not.toContain('data:');
    controller.abort();
    await new Promise((resolve) => setTimeout(resolve, 50));
    expect(h.cancels).toEqual([{ requestId: (await job).requestId, reason: 'client_closed', wasQueued: true }]);
  });

  it('gives each of n choices its role chunk and finish chunk', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', chatBody({ n: 2 }));
    await job;
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 1 }]);
    h.send([
      { type: 'text-delta', index: 0, text: 'x', tokens: 1 },
      { type: 'text-delta', index: 1, text: 'y', tokens: 1 },
    ]);
    h.send([
      { type: 'text-end', index: 0, finishReason: 'length' },
      { type: 'text-end', index: 1, finishReason: 'length' },
      { type: 'finish', usage: { promptTokens: 1, completionTokens: 2 } },
    ]);
    const frames = await readAll(await reply);
    const choices = frames.slice(0, -1).map((f) => (JSON.parse(f.replace(/^data: /, '')) as { choices: unknown[] }).choices[0]);
    expect(choices).toEqual([
      { index: 0, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null },
      { index: 1, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null },
      { index: 0, delta: { content: 'x' }, logprobs: null, finish_reason: null },
      { index: 1, delta: { content: 'y' }, logprobs: null, finish_reason: null },
      { index: 0, delta: {}, logprobs: null, finish_reason: 'length' },
      { index: 1, delta: {}, logprobs: null, finish_reason: 'length' },
    ]);
  });

  it('formats chat logprobs the OpenAI way', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', chatBody({ stream: false, logprobs: true, top_logprobs: 1 }));
    expect((await job).sampling).toMatchObject({ logprobs: true, topLogprobs: 1 });
    h.send([{ type: 'accepted', workerId: 'w1', promptTokens: 1 }]);
    h.send([
      {
        type: 'text-delta',
        index: 0,
        text: 'é',
        tokens: 1,
        logprobs: [{ token: 'é', logprob: -0.5, top: [{ token: 'é', logprob: -0.5 }] }],
      },
      { type: 'text-end', index: 0, finishReason: 'stop' },
      { type: 'finish', usage: { promptTokens: 1, completionTokens: 1 } },
    ]);
    const body = (await (await reply).json()) as { choices: Array<{ logprobs: unknown; message: unknown }> };
    expect(body.choices[0]).toMatchObject({
      message: { role: 'assistant', content: 'é' },
      logprobs: {
        content: [{ token: 'é', logprob: -0.5, bytes: [195, 169], top_logprobs: [{ token: 'é', logprob: -0.5, bytes: [195, 169] }] }],
      },
    });
  });

  it('turns a rejection before the 200 into an HTTP error naming the field the client sent', async () => {
    const h = await start();
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', chatBody({ max_completion_tokens: 50 }));
    await job;
    h.send([{ type: 'rejected', error: { code: 'context_length_exceeded', message: 'too long', param: 'max_tokens' } }]);
    const res = await reply;
    expect(res.status).toBe(400);
    expect(await res.json()).toEqual({
      error: { message: 'too long', type: 'invalid_request_error', param: 'max_completion_tokens', code: 'context_length_exceeded' },
    });
  });

  it('refuses a prompt that cannot fit the context with a 400 before any job, even with an early 200', async () => {
    const h = await start({ HEADERS_WAIT_MS: '0' });
    const tooMuch = await post(h, '/v1/chat/completions', chatBody({ max_completion_tokens: 500 }));
    expect(tooMuch.status).toBe(400);
    expect(await tooMuch.json()).toMatchObject({ error: { param: 'max_completion_tokens', code: 'context_length_exceeded' } });
    const longPrompt = await post(h, '/v1/chat/completions', chatBody({ messages: [{ role: 'user', content: 'x'.repeat(100) }] }));
    expect(longPrompt.status).toBe(400);
    expect(await longPrompt.json()).toMatchObject({ error: { param: 'messages', code: 'context_length_exceeded' } });
    const badIds = await post(h, '/v1/completions', JSON.stringify({ model: 'm', prompt: [1, 999], stream: true }));
    expect(badIds.status).toBe(400);
    expect(await badIds.json()).toMatchObject({ error: { param: 'prompt', code: 'invalid_request' } });
    expect(h.jobs).toEqual([]);
  });

  it('sends the job the prompt as token ids (the worker never tokenizes)', async () => {
    const h = await start();
    const job = h.nextJob();
    void post(h, '/v1/chat/completions', chatBody()).catch(() => undefined);
    expect((await job).input).toEqual({ kind: 'tokens', promptTokenIds: [104, 105] });
  });

  it('after an early 200, a rejection becomes an error frame', async () => {
    const h = await start({ HEADERS_WAIT_MS: '0' });
    const job = h.nextJob();
    const reply = post(h, '/v1/chat/completions', chatBody());
    await job;
    const res = await reply;
    expect(res.status).toBe(200);
    h.send([{ type: 'rejected', error: { code: 'context_length_exceeded', message: 'too long', param: 'prompt' } }]);
    const frames = await readAll(res);
    expect(frames).toEqual([expect.stringContaining('"param":"messages","code":"context_length_exceeded"'), 'data: [DONE]']);
  });

  it('refuses a body over MAX_BODY_BYTES with 413', async () => {
    const h = await start({ MAX_BODY_BYTES: '1024' });
    const res = await post(h, '/v1/chat/completions', chatBody({ messages: [{ role: 'user', content: 'x'.repeat(2000) }] }));
    expect(res.status).toBe(413);
    expect(((await res.json()) as { error: { code: string } }).error.code).toBe('request_too_large');
    expect(h.jobs).toEqual([]);
  });
});
