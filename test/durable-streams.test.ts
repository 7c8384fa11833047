import { inspect } from 'node:util';
import OpenAI from 'openai';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { startNginx, type NginxServer } from './support/nginx.js';
import { sleep, waitFor } from './support/processes.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { freezeMidAnswers, retryMidAnswer } from './support/mid-answer.js';
import { collect, empty, read, readSse, type Collected } from './support/sse.js';
import { scrapePrometheus } from './support/prometheus.js';
import { loggedAnswer, type LoggedAnswer } from './support/token-log.js';

/**
 * Durable token streams, from outside: real nginx → 2 gateways → one redis-server → 2 workers (the
 * tiny model), the official `openai` client and a plain `fetch` SSE reader. Every token of an admitted
 * request reaches its client exactly once whatever single gateway-side thing fails: a subscriber
 * connection, a gateway process, the client's own connection.
 */

/**
 * Short enough to test expiry; a running request's log lives until its deadline plus this. Long
 * enough for a client's six legs through nginx after its (800-token) stream ended on a loaded machine.
 */
const RETENTION_MS = 5_000;
const WORKER_ENV = {
  WORKER_HEARTBEAT_MS: '250',
  WORKER_TTL_MS: '1500',
  STREAM_RETENTION_MS: String(RETENTION_MS),
  MAX_BATCH_SIZE: '32',
  LOG_LEVEL: 'info',
};
const GATEWAY_ENV = { REGISTRY_POLL_MS: '200', STREAM_RETENTION_MS: String(RETENTION_MS), LOG_LEVEL: 'info' };

const body = (i: number, maxTokens: number, extra: Record<string, unknown> = {}) => ({
  model: MODEL,
  messages: [{ role: 'user', content: `Tell me a long story about thing number ${i}.` }],
  max_tokens: maxTokens,
  temperature: 0,
  ignore_eos: true,
  stream: true,
  ...extra,
});

/** Reads `count` more text chunks, then cuts the connection (a client whose network drops); the caller resumes. */
async function readThenDrop(res: Response, into: Collected, count: number, controller: AbortController): Promise<void> {
  const until = into.textChunks + count;
  await read(res, into, (c) => c.textChunks >= until);
  controller.abort();
}

/** The job id of a stream read so far (its chunks' `chatcmpl-{id}`). */
const jobOf = (out: Collected): { jobId: string } => ({ jobId: out.id!.replace(/^chatcmpl-/, '') });

function post(url: string, payload: unknown, signal?: AbortSignal): Promise<Response> {
  return fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(payload),
    ...(signal === undefined ? {} : { signal }),
  });
}

function resume(url: string, id: string, lastEventId: string | undefined, signal?: AbortSignal): Promise<Response> {
  return fetch(`${url}/v1/chat/completions/${id}?stream=true`, {
    headers: lastEventId === undefined ? {} : { 'last-event-id': lastEventId },
    ...(signal === undefined ? {} : { signal }),
  });
}

describe('durable token streams: nginx → 2 gateways → Redis → 2 workers', () => {
  let cluster: Cluster;
  let nginx: NginxServer;
  let redis: Redis;
  const gateways: GatewayProcess[] = [];
  const workers: WorkerProcess[] = [];
  /** The text of a request run alone, by `i/maxTokens`. */
  const alone = new Map<string, string>();

  async function textAlone(i: number, maxTokens: number): Promise<string> {
    const key = `${i}/${maxTokens}`;
    const known = alone.get(key);
    if (known !== undefined) return known;
    const out = empty();
    const res = await post(gateways[0]!.url, body(i, maxTokens));
    if (res.status !== 200) throw new Error(`request ${i} alone: ${res.status} ${await res.text()}`);
    await read(res, out);
    expect(out.errors, `request ${i} alone`).toEqual([]);
    expect(out.done, `request ${i} alone`).toBe(true);
    alone.set(key, out.text);
    return out.text;
  }

  beforeAll(async () => {
    cluster = await Cluster.start();
    redis = cluster.redis.client();
    workers.push(...(await Promise.all([cluster.worker(WORKER_ENV), cluster.worker(WORKER_ENV)])));
    gateways.push(...(await Promise.all([cluster.gateway(GATEWAY_ENV), cluster.gateway(GATEWAY_ENV)])));
    nginx = await startNginx({ upstreamPorts: gateways.map((g) => Number(new URL(g.url).port)) });
  }, 180_000);

  afterAll(async () => {
    redis?.disconnect();
    await nginx?.close();
    await cluster?.stop();
  });

  it("repairs every stream from its log while the gateways' subscriber connections are killed again and again", async () => {
    const client = new OpenAI({ baseURL: `${nginx.url}/v1`, apiKey: 'unused', maxRetries: 0 });
    const N = 32;
    const maxTokens = (i: number) => 600 + (i % 4) * 100;
    let open = N;
    let killsDuringStreams = 0;
    const killer = (async () => {
      while (open > 0) {
        const killed = Number(await redis.call('CLIENT', 'KILL', 'TYPE', 'pubsub'));
        if (killed > 0 && open > 0) killsDuringStreams++;
        await sleep(40);
      }
    })();
    const results = await Promise.all(
      Array.from({ length: N }, async (_, i) => {
        try {
          const stream = await client.chat.completions.create({ ...body(i, maxTokens(i)), stream: true } as never);
          let text = '';
          let finish: string | null = null;
          let jobId = '';
          for await (const chunk of stream as unknown as AsyncIterable<OpenAI.ChatCompletionChunk>) {
            text += chunk.choices[0]?.delta.content ?? '';
            finish = chunk.choices[0]?.finish_reason ?? finish;
            jobId ||= chunk.id.replace(/^chatcmpl-/, '');
          }
          // What the worker generated, read at once (the log is kept RETENTION_MS after the end).
          return { text, finish, logged: await loggedAnswer(redis, jobId), error: undefined as unknown };
        } catch (error) {
          return { text: '', finish: null, logged: undefined, error };
        } finally {
          open--;
        }
      }),
    );
    await killer;
    expect(killsDuringStreams, 'the subscribers were killed while streams ran').toBeGreaterThan(3);
    expect(
      results.map((r) => (r.error === undefined ? undefined : r.error instanceof Error ? r.error.message : inspect(r.error))),
      cluster
        .logs()
        .split('\n')
        .filter((l) => /"level":[45]0/.test(l) && !l.includes('subscriber reconnected'))
        .slice(0, 20)
        .join('\n'),
    ).toEqual(results.map(() => undefined));
    expect(results.map((r) => r.finish)).toEqual(results.map(() => 'length'));
    // Every token the worker logged reached the client once, in order: the repairs lost and repeated
    // nothing. (Compared with the log, not with the same request run alone: in the plain attention
    // form a batch of other shapes may flip a greedy near-tie hundreds of tokens in, docs/engine.md.)
    results.forEach((r, i) => {
      expect(r.logged, `stream ${i}`).toMatchObject({ tokens: maxTokens(i), ended: true });
      expect(r.text, `stream ${i}`).toBe(r.logged!.text);
    });
  });

  it('resumes the streams of a gateway killed with SIGKILL through nginx with Last-Event-ID: exactly the rest', async () => {
    // Behind nginx, streams land on both gateways; the victim is the first one, started directly on
    // it so the test knows which streams lose their gateway (the survivor's are unaffected anyway).
    const victim = await cluster.gateway(GATEWAY_ENV);
    const N = 8;
    const outs = Array.from({ length: N }, empty);
    /** What the workers generated, read from each request's log as soon as its stream ends. */
    const logged: Array<LoggedAnswer | undefined> = outs.map(() => undefined);
    const firstLegs = outs.map(async (out, i) => {
      const res = await post(victim.url, body(100 + i, 1500, { resume_grace_ms: 30_000 }));
      await read(res, out);
      if (out.done) logged[i] = await loggedAnswer(redis, jobOf(out).jobId);
    });
    await waitFor('every stream under way', () => (outs.every((o) => o.text.length > 0) ? true : undefined), 30_000);
    // Freeze generation so the kill lands mid-stream, whatever the machine's speed.
    for (const w of workers) w.process.child.kill('SIGSTOP');
    victim.process.child.kill('SIGKILL');
    await Promise.all(firstLegs);
    for (const w of workers) w.process.child.kill('SIGCONT');
    // A stream may have finished before the freeze on a fast machine; the others were cut mid-way.
    expect(outs.filter((o) => !o.done).length).toBeGreaterThan(N / 2);
    await Promise.all(
      outs.map(async (out, i) => {
        await read(await resume(nginx.url, out.id!, out.lastEventId), out);
        logged[i] ??= await loggedAnswer(redis, jobOf(out).jobId);
      }),
    );
    outs.forEach((out, i) => {
      expect(out.errors, `stream ${i}`).toEqual([]);
      expect(out.done).toBe(true);
      expect(logged[i], `stream ${i}`).toMatchObject({ tokens: 1500, ended: true });
      expect(out.text, `stream ${i}`).toBe(logged[i]!.text);
    });
  });

  it("stops the work of a killed gateway's clients that asked for no grace once the gateway is known dead", async () => {
    const victim = await cluster.gateway(GATEWAY_ENV);
    // The kill lands with every stream mid-answer, whatever the machine's speed (see mid-answer.ts).
    const { outs, legs } = await retryMidAnswer('a stream', async (attempt) => {
      const outs = Array.from({ length: 4 }, empty);
      const controllers = outs.map(() => new AbortController());
      const legs = outs.map(async (out, i) =>
        read(await post(victim.url, body(200 + 10 * attempt + i, 1500), controllers[i]!.signal), out),
      );
      await waitFor('every stream under way', () => (outs.every((o) => o.text.length > 0) ? true : undefined), 30_000);
      if ((await freezeMidAnswers(workers, redis, outs.map(jobOf), 1500)) !== null) return { outs, legs };
      for (const controller of controllers) controller.abort();
      await Promise.all(legs);
      return undefined;
    });
    const killedAt = Date.now();
    victim.process.child.kill('SIGKILL');
    await Promise.all(legs);
    for (const w of workers) w.process.signal('SIGCONT');
    // Workers notice when a publish reaches nobody and the gateway's alive key (3 s TTL) is gone.
    await waitFor(
      'the sequences stopped',
      async () => {
        const running = (await Promise.all(workers.map((w) => w.health()))).reduce((sum, h) => sum + h.running, 0);
        return running === 0 ? true : undefined;
      },
      15_000,
      50,
    );
    const stoppedMs = Date.now() - killedAt;
    console.log(`sequences of a SIGKILLed gateway stopped ${stoppedMs} ms after the kill (alive-key TTL 3000 ms)`);
    expect(stoppedMs).toBeLessThan(10_000);
    expect(outs.every((o) => !o.done)).toBe(true);
  });

  it('gives a client that drops and resumes 5 times during one long stream every token exactly once', async () => {
    const expected = await textAlone(300, 800);
    const out = empty();
    let controller = new AbortController();
    await readThenDrop(await post(nginx.url, body(300, 800, { resume_grace_ms: 30_000 }), controller.signal), out, 20, controller);
    for (let drop = 0; drop < 5; drop++) {
      controller = new AbortController();
      await readThenDrop(await resume(nginx.url, out.id!, out.lastEventId, controller.signal), out, 20, controller);
    }
    expect(out.done).toBe(false);
    const last = await resume(nginx.url, out.id!, out.lastEventId);
    if (last.status !== 200) {
      const jobId = out.id!.replace('chatcmpl-', '');
      const meta = await redis.hgetall(`sluice:{${jobId}}:meta`);
      throw new Error(
        `resume: ${last.status} ${await last.text()} meta=${JSON.stringify(meta)} ttl=${await redis.pttl(`sluice:{${jobId}}:meta`)} log=${await redis.xlen(`sluice:{${jobId}}:log`)}`,
      );
    }
    await read(last, out);
    expect(out.errors).toEqual([]);
    expect(out.done).toBe(true);
    expect(out.finishReasons).toEqual({ 0: 'length' });
    expect(out.text).toBe(expected);
  });

  it('resumes with ?starting_after= as with Last-Event-ID, and replays a finished stream from the start', async () => {
    const expected = await textAlone(301, 40);
    const first = empty();
    await read(await post(gateways[1]!.url, body(301, 40)), first);
    const again = empty();
    await read(await fetch(`${gateways[0]!.url}/v1/chat/completions/${first.id}?stream=true&starting_after=-1`), again);
    expect(again.text).toBe(expected);
    expect(again.done).toBe(true);
    const tail = empty();
    await read(await fetch(`${gateways[0]!.url}/v1/chat/completions/${first.id}?stream=true&starting_after=${first.lastEventId}`), tail);
    // Resumed after its last event: [DONE] at once, no chunk before it (it waited ~RETENTION_MS, then
    // failed `stream_interrupted`, until stop 22).
    expect(tail).toMatchObject({ id: undefined, text: '', textChunks: 0, done: true, errors: [] });
  });

  it("resumes a completions stream cut off before its first chunk by the reply's X-Stream-Id, behind nginx, and counts it as an active resumed stream", async () => {
    // nginx gives every request an X-Request-Id (the client's here), so the chunks' id is the
    // gateway's own: before this header, a client cut off before the first token could not name it.
    const payload = { model: MODEL, prompt: 'Once upon a time', max_tokens: 24, temperature: 0, ignore_eos: true, stream: true };
    const controller = new AbortController();
    const activeStreams = async () => {
      const scraped = await Promise.all(gateways.map((g) => scrapePrometheus(`${g.url}/metrics`)));
      const sum = (name: string) => scraped.reduce((total, m) => total + m.value(name), 0);
      return { active: sum('sluice_gateway_active_streams'), resumed: sum('sluice_gateway_active_resumed_streams') };
    };
    for (const w of workers) w.process.signal('SIGSTOP');
    let streamId: string | null;
    let resumed: Response;
    try {
      const first = await fetch(`${nginx.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'x-request-id': 'client-chosen-id' },
        body: JSON.stringify({ ...payload, resume_grace_ms: 30_000 }),
        signal: controller.signal,
      });
      expect(first.status).toBe(200);
      expect(first.headers.get('x-request-id')).toBe('client-chosen-id');
      streamId = first.headers.get('x-stream-id');
      controller.abort();
      expect(streamId).toMatch(/^cmpl-/);
      expect(streamId).not.toBe('cmpl-client-chosen-id');
      resumed = await fetch(`${nginx.url}/v1/completions/${streamId}?stream=true`);
      // Open while nothing can end it: an active stream of the gateway that took it, counted as resumed
      // (the first connection's end reaches its gateway meanwhile).
      await waitFor(
        'one active stream, the resumed one',
        async () => {
          const open = await activeStreams();
          return open.active === 1 && open.resumed === 1 ? true : undefined;
        },
        1_000,
      );
    } finally {
      for (const w of workers) w.process.signal('SIGCONT');
    }
    expect(resumed.status).toBe(200);
    expect(resumed.headers.get('x-stream-id')).toBe(streamId);
    const out = await collect(resumed);
    await waitFor('the resumed stream closed', async () => {
      const open = await activeStreams();
      return open.active === 0 && open.resumed === 0 ? true : undefined;
    });
    const logged = await loggedAnswer(redis, streamId!.slice('cmpl-'.length));
    expect(out).toMatchObject({ id: streamId, done: true, errors: [], finishReasons: { 0: 'length' } });
    expect(logged).toMatchObject({ tokens: 24, ended: true });
    expect(out.text).toBe(logged.text);
  });

  it('carries continuous_usage_stats on across a resume: every resumed chunk has the usage the original had there', async () => {
    type Chunk = { id?: string; usage?: { prompt_tokens: number; completion_tokens: number } | null; choices?: unknown[] };
    const chunksOf = async (res: Response): Promise<Array<{ eventId: string | undefined; chunk: Chunk }>> => {
      expect(res.status).toBe(200);
      const out: Array<{ eventId: string | undefined; chunk: Chunk }> = [];
      for await (const item of readSse(res.body!)) {
        if (item.kind !== 'data' || item.data === '[DONE]') continue;
        out.push({ eventId: item.id, chunk: JSON.parse(item.data) as Chunk });
      }
      return out;
    };
    const original = await chunksOf(
      await post(gateways[1]!.url, body(302, 30, { stream_options: { include_usage: true, continuous_usage_stats: true } })),
    );
    const usage = (chunks: typeof original) => chunks.map(({ chunk }) => [chunk.choices, chunk.usage]);
    expect(original.at(-2)!.chunk.usage).toMatchObject({ completion_tokens: 30 });
    // Every chunk of the original carries its own cursor (nothing coalesced): resume after the 10th.
    const cut = original.findIndex(({ eventId }, i) => i >= 10 && eventId !== undefined);
    const cursor = original[cut]!.eventId!;
    const resumed = await chunksOf(await resume(gateways[0]!.url, original[0]!.chunk.id!, cursor));
    expect(resumed.length).toBeGreaterThan(10);
    expect(usage(resumed)).toEqual(usage(original.slice(cut + 1)));
    expect(resumed[0]!.chunk.usage!.completion_tokens).toBeGreaterThan(0);
    // From before the first event: the whole stream again, usage and all.
    const replayed = await chunksOf(
      await fetch(`${gateways[0]!.url}/v1/chat/completions/${original[0]!.chunk.id}?stream=true&starting_after=-1`),
    );
    expect(usage(replayed)).toEqual(usage(original));
  });

  it('answers an unknown id, a cursor past the end, and an expired log with a clear 4xx', async () => {
    const unknown = await resume(nginx.url, 'chatcmpl-nope', '3');
    expect(unknown.status).toBe(404);
    expect(await unknown.json()).toMatchObject({ error: { type: 'invalid_request_error', param: 'id' } });

    const out = empty();
    await read(await post(nginx.url, body(400, 8)), out);
    const past = await resume(nginx.url, out.id!, String(Number(out.lastEventId) + 5));
    expect(past.status).toBe(400);
    expect(await past.json()).toMatchObject({ error: { param: 'Last-Event-ID' } });
    const bad = await resume(nginx.url, out.id!, 'abc');
    expect(bad.status).toBe(400);
    const completions = await fetch(`${nginx.url}/v1/completions/${out.id}?stream=true`);
    expect(completions.status).toBe(404);

    await sleep(RETENTION_MS + 500);
    const expired = await resume(nginx.url, out.id!, '0');
    expect(expired.status).toBe(404);
  });

  it('cancels a running stream from the other gateway: it ends with finish_reason abort and [DONE]', async () => {
    // Cancelled while its workers are frozen mid-answer (briefly: within their 1.5 s TTL), whatever the machine's speed.
    const { out, leg } = await retryMidAnswer('the stream', async (attempt) => {
      const out = empty();
      const leg = (async () => read(await post(gateways[0]!.url, body(500 + attempt, 1500)), out))();
      await waitFor('under way', () => (out.text.length > 0 ? true : undefined), 30_000);
      if ((await freezeMidAnswers(workers, redis, [jobOf(out)], 1500)) !== null) return { out, leg };
      await leg;
      return undefined;
    });
    let cancel: Response;
    try {
      cancel = await fetch(`${gateways[1]!.url}/v1/chat/completions/${out.id}/cancel`, { method: 'POST' });
    } finally {
      for (const w of workers) w.process.signal('SIGCONT');
    }
    expect(cancel.status).toBe(200);
    await leg;
    expect(out).toMatchObject({ finishReasons: { 0: 'abort' }, done: true, errors: [] });
    const missing = await fetch(`${gateways[1]!.url}/v1/chat/completions/chatcmpl-nope/cancel`, { method: 'POST' });
    expect(missing.status).toBe(404);
  });

  it('leaves no log or meta key behind once 1,000 finished requests are past their retention', async () => {
    for (let batch = 0; batch < 10; batch++) {
      await Promise.all(
        Array.from({ length: 100 }, async (_, i) => {
          const out = empty();
          await read(await post(gateways[i % 2]!.url, body(batch * 100 + i, 2)), out);
          expect(out.done).toBe(true);
        }),
      );
    }
    const logged = await redis.keys('sluice:{*}:*');
    expect(logged.length).toBeGreaterThan(0);
    await sleep(RETENTION_MS + 1_000);
    // Requests of the earlier tests with long deadlines may still hold keys; none of these 1,000 does.
    expect(await redis.keys('sluice:{*}:*')).toEqual([]);
  });
});
