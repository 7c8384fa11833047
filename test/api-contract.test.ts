import { Validator } from '@seriousme/openapi-schema-validator';
import { Ajv2020 } from 'ajv/dist/2020.js';
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import type { GatewayProcess } from './support/sluice.js';
import { collectSse } from './support/sse.js';

/**
 * The gateway's OpenAPI document against the real thing: a validator accepts the document, and one
 * valid request per documented operation (streams included, chunk by chunk) gets a reply that the
 * document's schema for its status and content type accepts. Then the official client's calls that
 * use the newer endpoints and request features.
 */

type Doc = { paths: Record<string, Record<string, { operationId: string; responses: Record<string, any> }>> };

describe('the OpenAPI document and the API it describes', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let doc: Doc;
  const ajv = new Ajv2020({ strict: false, validateSchema: false, validateFormats: false, allErrors: true });
  const covered = new Set<string>();

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker();
    gateway = await cluster.gateway();
    doc = (await (await fetch(`${gateway.url}/openapi.json`)).json()) as Doc;
    ajv.addSchema(doc, 'openapi.json');
  });

  afterAll(async () => {
    await cluster?.stop();
  });

  const pointer = (...parts: string[]) => `openapi.json#/${parts.map((p) => p.replace(/~/g, '~0').replace(/\//g, '~1')).join('/')}`;

  function validate(ref: string, value: unknown, what: string): void {
    const check = ajv.getSchema(ref) ?? ajv.compile({ $ref: ref });
    if (!check(value))
      throw new Error(
        `${what} does not match ${ref}: ${JSON.stringify(check.errors?.slice(0, 5))}\n${JSON.stringify(value).slice(0, 800)}`,
      );
  }

  /** Sends a request and checks the reply against the document's operation `method path`. */
  async function call(
    method: string,
    path: string,
    template: string,
    init: RequestInit & { json?: unknown } = {},
  ): Promise<{ status: number; body: unknown }> {
    const operation = doc.paths[template]?.[method.toLowerCase()];
    if (operation === undefined) throw new Error(`${method} ${template} is not documented`);
    covered.add(operation.operationId);
    const { json, ...rest } = init;
    const res = await fetch(`${gateway.url}${path}`, {
      method,
      ...rest,
      ...(json === undefined
        ? {}
        : { body: JSON.stringify(json), headers: { 'Content-Type': 'application/json', ...(rest.headers ?? {}) } }),
    });
    const status = String(res.status);
    const response = operation.responses[status];
    if (response === undefined) throw new Error(`${method} ${path}: status ${status} is not documented (${await res.text()})`);
    const type = (res.headers.get('content-type') ?? '').split(';')[0]!;
    expect(Object.keys(response.content ?? {}), `${method} ${path} content type`).toContain(type);
    const at = ['paths', template, method.toLowerCase(), 'responses', status, 'content', type];
    if (type === 'text/event-stream') {
      const items = await collectSse(res.body!);
      const data = items.filter((item) => item.kind === 'data').map((item) => (item as { data: string }).data);
      expect(data.at(-1)).toBe('[DONE]');
      const chunks = data.slice(0, -1).map((d) => JSON.parse(d) as unknown);
      chunks.forEach((chunk, i) => validate(pointer(...at, 'x-sse-data'), chunk, `${method} ${path} chunk ${i}`));
      return { status: res.status, body: chunks };
    }
    const body: unknown = type === 'application/json' ? await res.json() : await res.text();
    validate(pointer(...at, 'schema'), body, `${method} ${path} reply`);
    return { status: res.status, body };
  }

  it('is a valid OpenAPI 3.1 document', async () => {
    const result = await new Validator().validate(doc);
    expect(result.errors ?? []).toEqual([]);
    expect(result.valid).toBe(true);
    expect((doc as unknown as { openapi: string }).openapi).toBe('3.1.0');
  });

  it('describes generation replies and their stream chunks as the gateway writes them', async () => {
    const chat = { model: MODEL, messages: [{ role: 'user', content: 'Hello there' }], max_tokens: 6, temperature: 0 };
    await call('POST', '/v1/chat/completions', '/v1/chat/completions', { json: { ...chat, logprobs: true, top_logprobs: 2 } });
    const streamed = await call('POST', '/v1/chat/completions', '/v1/chat/completions', {
      json: {
        ...chat,
        stream: true,
        stream_options: { include_usage: true, continuous_usage_stats: true },
        logprobs: true,
        top_logprobs: 1,
      },
    });
    const chatId = (streamed.body as Array<{ id: string }>)[0]!.id;
    const completion = { model: MODEL, max_tokens: 5, temperature: 0 };
    await call('POST', '/v1/completions', '/v1/completions', {
      json: { ...completion, prompt: ['Once upon', [5, 6, 7]], echo: true, n: 2 },
    });
    const stream = await call('POST', '/v1/completions', '/v1/completions', {
      json: { ...completion, prompt: 'The sea', stream: true, logprobs: 2, stream_options: { include_usage: true } },
    });
    const completionId = (stream.body as Array<{ id: string }>)[0]!.id;

    // Durable streams: the rest of a finished stream, and a cancel (of a request that already ended).
    await call('GET', `/v1/chat/completions/${chatId}?stream=true`, '/v1/chat/completions/{id}', { headers: { 'Last-Event-ID': '0' } });
    await call('GET', `/v1/completions/${completionId}?stream=true&starting_after=1`, '/v1/completions/{id}');
    await call('POST', `/v1/chat/completions/${chatId}/cancel`, '/v1/chat/completions/{id}/cancel');
    await call('POST', `/v1/completions/${completionId}/cancel`, '/v1/completions/{id}/cancel');
  });

  it('describes the models, tokenization and operations endpoints', async () => {
    await call('GET', '/v1/models', '/v1/models');
    expect((await call('GET', `/v1/models/${MODEL}`, '/v1/models/{id}')).body).toMatchObject({ id: MODEL, object: 'model' });
    const tokenized = await call('POST', '/tokenize', '/tokenize', { json: { model: MODEL, prompt: 'Hello world' } });
    const ids = (tokenized.body as { tokens: number[] }).tokens;
    expect(ids.length).toBeGreaterThan(0);
    const chat = await call('POST', '/tokenize', '/tokenize', {
      json: { model: MODEL, messages: [{ role: 'user', content: 'Hello world' }] },
    });
    expect((chat.body as { count: number }).count).toBeGreaterThan(ids.length);
    const text = await call('POST', '/detokenize', '/detokenize', { json: { model: MODEL, tokens: ids } });
    expect((text.body as { prompt: string }).prompt).toContain('Hello world');
    for (const path of ['/health', '/healthz', '/readyz', '/version', '/metrics']) await call('GET', path, path);
  });

  it('describes the errors it answers with', async () => {
    const refused = await call('POST', '/v1/chat/completions', '/v1/chat/completions', {
      json: { model: MODEL, messages: [{ role: 'user', content: 'x' }], tools: [{ type: 'function', function: { name: 'f' } }] },
    });
    expect(refused).toMatchObject({ status: 400, body: { error: { param: 'tools' } } });
    expect((await call('GET', '/v1/models/nope', '/v1/models/{id}')).status).toBe(404);
    expect((await call('GET', '/v1/completions/cmpl-unknown?stream=true', '/v1/completions/{id}')).status).toBe(404);
    const tokenize = await call('POST', '/tokenize', '/tokenize', { json: { model: MODEL } });
    expect(tokenize).toMatchObject({ status: 400, body: { error: { param: 'prompt' } } });
  });

  it('was exercised on every documented operation', () => {
    const documented = Object.values(doc.paths).flatMap((item) => Object.values(item).map((op) => op.operationId));
    expect([...covered].sort()).toEqual(documented.sort());
  });
});

describe('the official openai client on the newer endpoints and request features', () => {
  let cluster: Cluster;
  let client: OpenAI;
  let gateway: GatewayProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker();
    gateway = await cluster.gateway();
    client = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: 'unused', maxRetries: 0 });
  });

  afterAll(async () => {
    await cluster?.stop();
  });

  it('retrieves a model', async () => {
    expect(await client.models.retrieve(MODEL)).toMatchObject({ id: MODEL, object: 'model', owned_by: 'sluice' });
    await expect(client.models.retrieve('nope')).rejects.toMatchObject({ status: 404 });
  });

  it("continues a conversation with the reply's message pushed back as received, and renders developer as system", async () => {
    const messages: OpenAI.ChatCompletionMessageParam[] = [
      { role: 'developer', content: 'Answer briefly.' },
      { role: 'user', content: 'Hi!' },
    ];
    const first = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 4, temperature: 0 });
    // OpenAI's own pattern: the reply's message (with its `refusal: null`) goes back as it is.
    expect(first.choices[0]!.message).toHaveProperty('refusal', null);
    messages.push(first.choices[0]!.message, { role: 'user', content: 'And then?' });
    const second = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 4, temperature: 0 });
    expect(second.choices[0]!.finish_reason).toMatch(/stop|length/);
    // Stored completions are OpenAI's: the client's retrieve is told so, naming `stream`.
    const stored = await client.chat.completions.retrieve(first.id).catch((e: unknown) => e);
    expect(stored).toBeInstanceOf(OpenAI.BadRequestError);
    expect((stored as InstanceType<typeof OpenAI.BadRequestError>).message).toMatch(/stored completions .* are not supported/);
    // developer renders as system: the same prompt tokens.
    const tokenize = async (role: string) =>
      (
        (await (
          await fetch(`${gateway.url}/tokenize`, {
            method: 'POST',
            headers: { 'Content-Type': 'application/json' },
            body: JSON.stringify({
              model: MODEL,
              messages: [
                { role, content: 'Answer briefly.' },
                { role: 'user', content: 'Hi!' },
              ],
            }),
          })
        ).json()) as { tokens: number[] }
      ).tokens;
    expect(await tokenize('developer')).toEqual(await tokenize('system'));
  });

  it('completes a batch of prompts, choices indexed prompt × n + choice, each as it would be alone', async () => {
    const prompts = ['Once upon a time', 'The sea'];
    const batch = await client.completions.create({ model: MODEL, prompt: prompts, n: 2, max_tokens: 6, temperature: 0 });
    expect(batch.choices.map((c) => c.index)).toEqual([0, 1, 2, 3]);
    for (const [k, prompt] of prompts.entries()) {
      const alone = await client.completions.create({ model: MODEL, prompt, max_tokens: 6, temperature: 0 });
      expect(batch.choices[k * 2]!.text).toBe(alone.choices[0]!.text);
      expect(batch.choices[k * 2 + 1]!.text).toBe(alone.choices[0]!.text);
    }
    expect(batch.usage!.completion_tokens).toBe(batch.choices.length * 6);
    // Streamed, every choice index arrives and ends.
    const stream = await client.completions.create({
      model: MODEL,
      prompt: [
        [5, 6, 7],
        [8, 9],
      ],
      max_tokens: 3,
      temperature: 0,
      stream: true,
    });
    const ended = new Set<number>();
    for await (const chunk of stream) for (const choice of chunk.choices) if (choice.finish_reason !== null) ended.add(choice.index);
    expect([...ended].sort()).toEqual([0, 1]);
  });

  it('echoes the prompt, whole and streamed', async () => {
    const whole = await client.completions.create({ model: MODEL, prompt: 'Once upon a time', max_tokens: 4, temperature: 0, echo: true });
    expect(whole.choices[0]!.text.startsWith('Once upon a time')).toBe(true);
    const stream = await client.completions.create({
      model: MODEL,
      prompt: 'Once upon a time',
      max_tokens: 4,
      temperature: 0,
      echo: true,
      stream: true,
    });
    let text = '';
    for await (const chunk of stream) text += chunk.choices[0]?.text ?? '';
    expect(text).toBe(whole.choices[0]!.text);
    expect(whole.system_fingerprint).toMatch(/^fp_/);
  });

  it("gives chat logprobs the vocabulary's raw bytes: together they spell the answer's UTF-8", async () => {
    const reply = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'user', content: 'Write something.' }],
      max_tokens: 48,
      temperature: 0,
      logprobs: true,
      top_logprobs: 2,
    });
    const content = reply.choices[0]!.logprobs!.content!;
    expect(Buffer.from(content.flatMap((lp) => lp.bytes!)).toString('utf8')).toBe(reply.choices[0]!.message.content);
    for (const lp of content) {
      // A token that holds part of a character shows as U+FFFD; its bytes are the vocabulary's.
      if (lp.token.includes('\uFFFD')) expect(lp.bytes).not.toEqual([0xef, 0xbf, 0xbd]);
      for (const top of lp.top_logprobs) expect(top.bytes!.length).toBeGreaterThan(0);
    }
  });

  it('gives completions logprobs with the sampled token among top_logprobs, also for logprobs: 0', async () => {
    for (const k of [0, 3]) {
      const reply = await client.completions.create({ model: MODEL, prompt: 'The sea', max_tokens: 5, temperature: 0, logprobs: k });
      const logprobs = reply.choices[0]!.logprobs!;
      expect(logprobs.tokens!.length).toBe(5);
      logprobs.top_logprobs!.forEach((top, i) => {
        const entries = Object.keys(top);
        expect(entries).toContain(logprobs.tokens![i]);
        expect(entries.length).toBeGreaterThanOrEqual(Math.max(1, k));
        expect(entries.length).toBeLessThanOrEqual(k + 1);
        expect(top[logprobs.tokens![i]!]).toBeCloseTo(logprobs.token_logprobs![i]!, 5);
      });
      // Greedy: the sampled token is the most likely one.
      if (k > 0)
        logprobs.top_logprobs!.forEach((top, i) => expect(Math.max(...Object.values(top))).toBeCloseTo(logprobs.token_logprobs![i]!, 5));
    }
  });

  it("takes logit_bias: -100 makes the greedy first token give way, +100 makes one token fill the answer, logprobs the raw model's", async () => {
    const ask = (logitBias?: Record<string, number>) =>
      client.completions.create({
        model: MODEL,
        prompt: 'The sea',
        max_tokens: 4,
        temperature: 0,
        logprobs: 0,
        ...(logitBias === undefined ? {} : { logit_bias: logitBias }),
      });
    const first = (await ask()).choices[0]!.logprobs!.tokens![0]!;
    const tokenized = await fetch(`${gateway.url}/tokenize`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, prompt: first }),
    });
    const ids = ((await tokenized.json()) as { tokens: number[] }).tokens;
    expect(ids.length).toBeGreaterThan(0);
    const banned = await ask(Object.fromEntries(ids.map((id) => [String(id), -100])));
    expect(banned.choices[0]!.logprobs!.tokens![0]).not.toBe(first);
    const forced = (await ask({ [String(ids.at(-1))]: 100 })).choices[0]!.logprobs!;
    expect(forced.tokens).toEqual([first, first, first, first]);
    // The model's own logprobs: a token it would not pick by itself keeps its low probability.
    for (const logprob of forced.token_logprobs!) expect(logprob).toBeLessThan(0);
  });
});
