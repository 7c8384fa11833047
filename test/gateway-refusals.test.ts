import { connect } from 'node:net';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createKey } from './support/api-keys.js';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep, waitFor } from './support/processes.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { startFrozenMidAnswers } from './support/mid-answer.js';
import { LiveStream, postRaw } from './support/sse.js';

interface ErrorBody {
  error: { message: string; type: string; param: string | null; code: string };
}

const chat = (extra: Record<string, unknown> = {}) => ({
  model: MODEL,
  messages: [{ role: 'user', content: 'Hello' }],
  max_tokens: 4,
  temperature: 0,
  ...extra,
});

describe('refusals before any SSE byte', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let worker: WorkerProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: a worker frozen for the queue bound test (SIGSTOP) is not "lost".
    worker = await cluster.worker({ MAX_BATCH_SIZE: '1', WORKER_TTL_MS: '60000' });
    gateway = await cluster.gateway();
  });

  afterAll(async () => {
    worker?.process.signal('SIGCONT');
    await cluster?.stop();
  });

  async function refused(path: string, body: unknown) {
    const res = await postRaw(`${gateway.url}${path}`, body);
    expect(res.headers.get('content-type')).toMatch(/^application\/json/);
    return { status: res.status, error: (res.json as ErrorBody).error, headers: res.headers };
  }

  for (const stream of [false, true]) {
    describe(`with stream: ${stream}`, () => {
      it('refuses a body that is not JSON with 400', async () => {
        const { status, error } = await refused('/v1/chat/completions', `{"model": "${MODEL}", "stream": ${stream}, `);
        expect(status).toBe(400);
        expect(error).toMatchObject({ type: 'invalid_request_error', code: 'invalid_json', param: null });
      });

      it('names the bad field with 400', async () => {
        const badFields: Array<[Record<string, unknown>, string]> = [
          [{ temperature: 3 }, 'temperature'],
          [{ top_p: 0 }, 'top_p'],
          [{ n: 0 }, 'n'],
          [{ max_tokens: -1 }, 'max_tokens'],
          [{ messages: [] }, 'messages'],
          [{ messages: [{ role: 'wizard', content: 'hi' }] }, 'messages[0].role'],
          [{ stop: 7 }, 'stop'],
          [{ top_logprobs: 2 }, 'top_logprobs'],
          [{ logit_bias: { '1': 101 } }, 'logit_bias.1'],
          [{ logit_bias: { '999999': 5 } }, 'logit_bias'],
        ];
        for (const [extra, param] of badFields) {
          const { status, error } = await refused('/v1/chat/completions', chat({ stream, ...extra }));
          expect(status, param).toBe(400);
          expect(error, param).toMatchObject({ type: 'invalid_request_error', param });
        }
        const missing = await refused('/v1/completions', { model: MODEL, stream });
        expect(missing.status).toBe(400);
        expect(missing.error.param).toBe('prompt');
        const noModel = await refused('/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], stream });
        expect(noModel.error.param).toBe('model');
      });

      it('refuses an unknown model with 404 naming model', async () => {
        const { status, error } = await refused('/v1/chat/completions', chat({ stream, model: 'no-such-model' }));
        expect(status).toBe(404);
        expect(error).toMatchObject({ code: 'model_not_found', param: 'model' });
      });

      it("refuses a prompt that does not fit the model's context with 400, naming the field", async () => {
        const long = 'word '.repeat(5000);
        const chatTooLong = await refused('/v1/chat/completions', chat({ stream, messages: [{ role: 'user', content: long }] }));
        expect(chatTooLong.status).toBe(400);
        expect(chatTooLong.error).toMatchObject({ code: 'context_length_exceeded', param: 'messages' });
        const completionTooLong = await refused('/v1/completions', { model: MODEL, prompt: long, max_tokens: 4, stream });
        expect(completionTooLong.error).toMatchObject({ code: 'context_length_exceeded', param: 'prompt' });
        const tooManyTokens = await refused('/v1/chat/completions', chat({ stream, max_tokens: 100_000 }));
        expect(tooManyTokens.error).toMatchObject({ code: 'context_length_exceeded', param: 'max_tokens' });
        const tooManyCompletionTokens = await refused(
          '/v1/chat/completions',
          chat({ stream, max_tokens: undefined, max_completion_tokens: 100_000 }),
        );
        expect(tooManyCompletionTokens.error).toMatchObject({ code: 'context_length_exceeded', param: 'max_completion_tokens' });
      });

      it('names the prompt of a batch that it refuses, prompt[k], and says what is wrong with an empty list', async () => {
        const completion = (prompt: unknown) => refused('/v1/completions', { model: MODEL, prompt, max_tokens: 4, stream });
        const empty = await completion(['a', '']);
        expect(empty.status).toBe(400);
        expect(empty.error).toMatchObject({ code: 'invalid_request', param: 'prompt[1]', message: 'prompt[1]: must not be empty.' });
        const outOfVocabulary = await completion([[1, 2], [10_000_000]]);
        expect(outOfVocabulary.error).toMatchObject({ code: 'invalid_request', param: 'prompt[1]' });
        expect(outOfVocabulary.error.message).toMatch(/^prompt\[1\]: token ids must be in/);
        const tooLong = await completion(['word '.repeat(5000), 'a']);
        expect(tooLong.error).toMatchObject({ code: 'context_length_exceeded', param: 'prompt[0]' });
        // A single prompt is `prompt`, as before.
        expect((await completion('')).error).toMatchObject({ param: 'prompt', message: 'prompt: must not be empty.' });
        expect((await completion([])).error).toMatchObject({ param: 'prompt', message: 'prompt: must hold at least one prompt.' });
      });
    });
  }

  it('answers 404 with an OpenAI error body for an unknown route', async () => {
    const res = await fetch(`${gateway.url}/v1/nothing`);
    expect(res.status).toBe(404);
    expect(((await res.json()) as ErrorBody).error.code).toBe('not_found');
  });

  it('refuses requests beyond the queue bound with 429 and Retry-After', async () => {
    const bounded = await cluster.gateway({ MAX_QUEUED_REQUESTS: '1', RETRY_AFTER_S: '2', HEADERS_WAIT_MS: '0' });
    const long = { model: MODEL, prompt: 'Once upon a time', max_tokens: 1500, ignore_eos: true, temperature: 0, stream: true };
    // The worker's one batch slot, held by a stream frozen mid-answer (see mid-answer.ts): the tiny
    // model could finish 1,500 tokens before the next request arrives, which would then run, not wait.
    const redis = cluster.redis.client();
    const running = await startFrozenMidAnswers([worker], redis, {
      start: () => [new LiveStream(`${bounded.url}/v1/completions`, long)],
      progress: (stream) => stream.until('the first stream running', () => stream.contentChunks > 0),
      maxTokens: long.max_tokens,
    })
      .then(({ streams }) => streams[0]!)
      .finally(() => redis.disconnect());
    // Then the one queue place.
    const queued = new LiveStream(`${bounded.url}/v1/completions`, long);
    try {
      expect(await queued.headers).toBe(200);
      const refusedRes = await fetch(`${bounded.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify(chat({ stream: true })),
      });
      expect(refusedRes.status).toBe(429);
      expect(refusedRes.headers.get('retry-after')).toBe('2');
      expect(((await refusedRes.json()) as ErrorBody).error).toMatchObject({ code: 'queue_full', type: 'rate_limit_error' });
    } finally {
      running.abort();
      queued.abort();
      worker.process.signal('SIGCONT');
    }
    await Promise.all([running.ended, queued.ended]);
    await waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
  });

  it('holds the queue bound for requests of a key with limits that arrive together', async () => {
    // The key's limits take a Redis round trip after the bound's check: ten requests whose bodies
    // complete together all passed the check meanwhile, and all ten were queued past a bound of 2.
    const key = await createKey(cluster.redis.url, ['--name', 'together', '--rpm', '1000']);
    const bounded = await cluster.gateway({ AUTH: 'keys', MAX_QUEUED_REQUESTS: '2', HEADERS_WAIT_MS: '0' });
    const body = JSON.stringify(chat({ stream: true, max_tokens: 5 }));
    const { port, hostname } = new URL(bounded.url);
    worker.process.signal('SIGSTOP');
    const clients = Array.from({ length: 10 }, () => {
      const socket = connect(Number(port), hostname);
      let reply = '';
      socket.setEncoding('utf8').on('data', (data: string) => (reply += data));
      // Each request but its body's last byte: its headers (and key) are read, its body waits.
      socket.write(
        `POST /v1/chat/completions HTTP/1.1\r\nHost: ${hostname}\r\nContent-Type: application/json\r\n` +
          `Authorization: Bearer ${key}\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body.slice(0, -1)}`,
      );
      return { socket, reply: () => reply };
    });
    try {
      await sleep(300);
      for (const client of clients) client.socket.write(body.slice(-1));
      const statuses = await waitFor('every reply', () => {
        const lines = clients.map((client) => client.reply().split('\r\n')[0] ?? '');
        return lines.every((line) => line.startsWith('HTTP/1.1')) ? lines.map((line) => Number(line.split(' ')[1])) : undefined;
      });
      expect(statuses.filter((status) => status === 200).length).toBe(2);
      expect(statuses.filter((status) => status !== 200 && status !== 429)).toEqual([]);
      for (const client of clients.filter((c) => c.reply().startsWith('HTTP/1.1 429')))
        expect(client.reply()).toMatch(/"code":"queue_full"/);
    } finally {
      for (const client of clients) client.socket.destroy();
      worker.process.signal('SIGCONT');
    }
    await waitFor('worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
  });
});
