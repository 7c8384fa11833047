import { connect, createServer, type Server, type Socket } from 'node:net';
import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { batchRequestId } from '@sluice/protocol';
import { Cluster, MODEL } from './support/cluster.js';
import { freeze, freezeMidAnswers, retryMidAnswer, thaw, unfinishedInLog } from './support/mid-answer.js';
import { sleep, waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import { collect, collectSse, empty, read } from './support/sse.js';
import { readTokenLog } from './support/token-log.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * The resume and cancel routes under the faults and requests that broke them, from outside: real
 * redis-server, two gateways (the second behind a TCP proxy that can hold its Redis commands), two
 * workers (the tiny model), plain `fetch` and raw sockets.
 * - A stream resumed on another gateway still moves to another worker when its worker dies.
 * - A client that leaves while the resume reads Redis takes nothing over.
 * - `HEAD` on the resume URL has no side effect.
 * - A completions batch is refused a resume (400 naming why) and is cancelled whole.
 */

const WORKER_ENV = {
  WORKER_HEARTBEAT_MS: '250',
  // Long enough that a worker frozen for a test's few steps is never taken for dead meanwhile; a
  // killed one is seen gone within it.
  WORKER_TTL_MS: '5000',
  MAX_BATCH_SIZE: '32',
  LOG_LEVEL: 'info',
};
const GATEWAY_ENV = { REGISTRY_POLL_MS: '200', LOG_LEVEL: 'info' };

const chatBody = (maxTokens: number, extra: Record<string, unknown> = {}) => ({
  model: MODEL,
  messages: [{ role: 'user', content: 'Tell me a long story about the resumed stream.' }],
  max_tokens: maxTokens,
  temperature: 0,
  ignore_eos: true,
  stream: true,
  ...extra,
});

function post(url: string, path: string, payload: unknown, signal?: AbortSignal): Promise<Response> {
  return fetch(`${url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(payload),
    ...(signal === undefined ? {} : { signal }),
  });
}

const jobOf = (chunkId: string) => chunkId.replace(/^(chatcmpl|cmpl)-/, '');
const metaKey = (jobId: string) => `sluice:{${jobId}}:meta`;

/**
 * A TCP proxy in front of Redis that, once armed with a marker, holds everything a client connection
 * sends from the chunk that contains the marker on (the command and whatever follows it) until released.
 */
class HoldingProxy {
  private marker: string | undefined;
  private held: Array<() => void> = [];
  private readonly sockets = new Set<Socket>();

  private constructor(
    private readonly server: Server,
    readonly port: number,
  ) {}

  static async start(redisPort: number): Promise<HoldingProxy> {
    const server = createServer();
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const address = server.address();
    const proxy = new HoldingProxy(server, typeof address === 'object' && address !== null ? address.port : 0);
    server.on('connection', (client: Socket) => proxy.pipe(client, redisPort));
    return proxy;
  }

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  /** Holds the next connection that sends `marker`, from then on. */
  arm(marker: string): void {
    this.marker = marker;
  }

  get holding(): boolean {
    return this.held.length > 0;
  }

  release(): void {
    this.marker = undefined;
    const held = this.held;
    this.held = [];
    for (const resume of held) resume();
  }

  async stop(): Promise<void> {
    this.release();
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  private pipe(client: Socket, redisPort: number): void {
    const upstream = connect(redisPort, '127.0.0.1');
    for (const socket of [client, upstream]) {
      this.sockets.add(socket);
      socket.on('error', () => undefined);
      socket.on('close', () => {
        this.sockets.delete(socket);
        client.destroy();
        upstream.destroy();
      });
    }
    upstream.pipe(client);
    let queue: Buffer[] | undefined;
    client.on('data', (chunk: Buffer) => {
      if (queue === undefined && this.marker !== undefined && chunk.includes(this.marker)) {
        queue = [];
        this.held.push(() => {
          for (const pending of queue ?? []) upstream.write(pending);
          queue = undefined;
        });
      }
      if (queue !== undefined) queue.push(chunk);
      else upstream.write(chunk);
    });
  }
}

describe('resume and cancel, hardened: redis-server, 2 gateways, 2 workers', () => {
  let cluster: Cluster;
  let proxy: HoldingProxy;
  let redis: Redis;
  /** A: where streams start. B: where they resume, its Redis behind the proxy. */
  let a: GatewayProcess;
  let b: GatewayProcess;
  const alone = new Map<string, string>();

  beforeAll(async () => {
    cluster = await Cluster.start();
    proxy = await HoldingProxy.start(cluster.redis.port);
    await Promise.all([cluster.worker(WORKER_ENV), cluster.worker(WORKER_ENV)]);
    [a, b] = await Promise.all([cluster.gateway(GATEWAY_ENV), cluster.gateway({ ...GATEWAY_ENV, REDIS_URL: proxy.url })]);
    redis = cluster.redis.client();
  }, 180_000);

  afterAll(async () => {
    for (const w of cluster?.workers ?? []) thaw([w]);
    redis?.disconnect();
    await proxy?.stop();
    await cluster?.stop();
  });

  const alive = (w: WorkerProcess) => w.process.child.exitCode === null && w.process.child.signalCode === null;

  /** Starts workers until two are alive (a test before may have killed one). */
  async function ensureWorkers(): Promise<WorkerProcess[]> {
    const live = cluster.workers.filter(alive);
    await Promise.all(Array.from({ length: Math.max(0, 2 - live.length) }, () => cluster.worker(WORKER_ENV)));
    return cluster.workers.filter(alive);
  }

  /** The text of the request run alone (greedy: the same on any worker, migrated or not). */
  async function textAlone(maxTokens: number): Promise<string> {
    const known = alone.get(String(maxTokens));
    if (known !== undefined) return known;
    const out = await collect(await post(a.url, '/v1/chat/completions', chatBody(maxTokens)));
    expect(out.errors).toEqual([]);
    alone.set(String(maxTokens), out.text);
    return out.text;
  }

  /** The live worker running the request (its meta's `workerId` names the worker's pid). */
  async function holderOf(jobId: string): Promise<WorkerProcess> {
    const workerId = await waitFor('the request accepted', async () => (await redis.hget(metaKey(jobId), 'workerId')) || undefined);
    const holder = cluster.workers.find((w) => alive(w) && workerId.includes(String(w.process.pid)));
    expect(holder, `the worker running ${jobId} (${workerId})`).toBeDefined();
    return holder!;
  }

  const metric = async (gateway: GatewayProcess, name: string, labels: Record<string, string>) =>
    (await scrapePrometheus(`${gateway.url}/metrics`)).value(name, labels);

  describe('when the worker of a resumed stream dies', () => {
    it('moves the stream to another worker, token-identical, from the gateway where it was resumed', async () => {
      await ensureWorkers();
      const maxTokens = 1200;
      const reference = await textAlone(maxTokens);
      // Mid-answer on any machine: the worker running it is frozen with its answer unfinished in its log.
      const started = await retryMidAnswer('the stream', async () => {
        const controller = new AbortController();
        const res = await post(a.url, '/v1/chat/completions', chatBody(maxTokens, { resume_grace_ms: 60_000 }), controller.signal);
        expect(res.status).toBe(200);
        const before = empty();
        await read(res, before, (out) => out.text.length > 20);
        const jobId = jobOf(before.id!);
        const holder = await holderOf(jobId);
        const frozen = await freezeMidAnswers([holder], redis, [{ jobId }], maxTokens);
        // The client leaves within its grace: the request is detached, its worker frozen.
        controller.abort();
        await waitFor('the request detached', async () => ((await redis.hget(metaKey(jobId), 'channel')) === '' ? true : undefined));
        if (frozen !== null) return { before, jobId, holder };
        await waitFor('the dropped request ended', async () => ((await unfinishedInLog(redis, jobId, Infinity)) ? undefined : true));
        return undefined;
      });
      const { before, jobId, holder } = started;
      try {
        // The client comes back on the other gateway; then the worker that ran its request dies.
        const resumed = await fetch(`${b.url}/v1/chat/completions/${before.id}?stream=true`, {
          headers: { 'Last-Event-ID': before.lastEventId! },
        });
        expect(resumed.status).toBe(200);
        const after = empty();
        const reading = read(resumed, after);
        await waitFor('the stream routed to gateway B', async () => (await redis.hget(metaKey(jobId), 'channel')) || undefined);
        // Nobody moved it while it was detached: only gateway B, which holds its stream, can.
        expect(await redis.hget(metaKey(jobId), 'attempt')).toBe('1');
        holder.process.signal('SIGKILL');
        await reading;
        expect(after.errors).toEqual([]);
        expect(after.done).toBe(true);
        expect(before.text + after.text).toBe(reference);
        expect(await redis.hget(metaKey(jobId), 'attempt')).toBe('2');
        expect(await metric(b, 'sluice_gateway_stream_migrations_total', {})).toBeGreaterThanOrEqual(1);
      } finally {
        thaw([holder]);
      }
    });
  });

  describe('when the client leaves while the resume reads the request from Redis', () => {
    it('takes nothing over: the request stays detached, and the resume counts as a client that left', async () => {
      await ensureWorkers();
      // A stream whose client left within its grace: detached, as a resume finds it.
      const controller = new AbortController();
      const res = await post(a.url, '/v1/chat/completions', chatBody(300, { resume_grace_ms: 60_000 }), controller.signal);
      const before = empty();
      await read(res, before, (out) => out.text.length > 5);
      controller.abort();
      const jobId = jobOf(before.id!);
      await waitFor('the request detached', async () => ((await redis.hget(metaKey(jobId), 'channel')) === '' ? true : undefined));

      const route = '/v1/chat/completions/{id}';
      const [leftBefore, closedBefore, resumesBefore] = await Promise.all([
        metric(b, 'sluice_gateway_requests_total', { route, status: '499' }),
        metric(b, 'sluice_gateway_rejected_total', { reason: 'client_closed' }),
        metric(b, 'sluice_gateway_stream_resumes_total', {}),
      ]);
      proxy.arm(metaKey(jobId));
      try {
        const socket = connect(Number(new URL(b.url).port), '127.0.0.1');
        socket.on('error', () => undefined);
        await new Promise<void>((resolve) => socket.once('connect', () => resolve()));
        socket.write(
          `GET /v1/chat/completions/${before.id}?stream=true HTTP/1.1\r\nHost: 127.0.0.1\r\nLast-Event-ID: ${before.lastEventId}\r\n\r\n`,
        );
        // Gateway B awaits the request's meta (held by the proxy) when its client leaves.
        await waitFor('gateway B to read the meta', () => (proxy.holding ? true : undefined), 10_000);
        socket.destroy();
        await waitFor('gateway B to see the client leave', async () =>
          (await metric(b, 'sluice_gateway_requests_total', { route, status: '499' })) > leftBefore ? true : undefined,
        );
      } finally {
        proxy.release();
      }
      // Either it was refused as a client that left, or (the defect) it took the request over.
      await waitFor('the resume handled', async () =>
        (await metric(b, 'sluice_gateway_rejected_total', { reason: 'client_closed' })) > closedBefore ||
        (await redis.hget(metaKey(jobId), 'channel')) !== ''
          ? true
          : undefined,
      );
      expect(await redis.hget(metaKey(jobId), 'channel'), 'the route (empty: still detached)').toBe('');
      expect(await metric(b, 'sluice_gateway_stream_resumes_total', {})).toBe(resumesBefore);
    });
  });

  describe('a queued stream resumed on another gateway, then its first connection closes (grace 0)', () => {
    it('is not cancelled by the first gateway: the resumed stream gets the whole answer', async () => {
      const workers = await ensureWorkers();
      const maxTokens = 40;
      const reference = await textAlone(maxTokens);
      // Every worker frozen: the job waits in BullMQ for as long as the test needs.
      await freeze(workers);
      let resumed: Response | undefined;
      try {
        const res = await post(a.url, '/v1/chat/completions', chatBody(maxTokens));
        expect(res.status).toBe(200);
        const streamId = res.headers.get('x-stream-id')!;
        const jobId = jobOf(streamId);
        const channelA = await redis.hget(metaKey(jobId), 'channel');
        expect(channelA).toBeTruthy();
        // Resumed from the start on gateway B while the first connection (to A) is still open.
        resumed = await fetch(`${b.url}/v1/chat/completions/${streamId}?stream=true`);
        expect(resumed.status).toBe(200);
        await waitFor('the stream routed to gateway B', async () =>
          ((await redis.hget(metaKey(jobId), 'channel')) ?? channelA) !== channelA ? true : undefined,
        );
        // The first connection closes: without a grace, A cancels the work of the sessions it holds.
        const leftBefore = await metric(a, 'sluice_gateway_disconnects_total', { stage: 'queued' });
        // Cancelling its unread body closes it, and holds `res` until here: undici closes the unread
        // body of a Response once it is garbage collected.
        await res.body!.cancel();
        await waitFor('gateway A to see its client leave', async () =>
          (await metric(a, 'sluice_gateway_disconnects_total', { stage: 'queued' })) > leftBefore ? true : undefined,
        );
        // A's cancel goes out as its client leaves: a moment lets a cancel that ignores the route show
        // (removing the job) before the workers thaw; the answer checked below does not depend on it.
        await sleep(500);
        expect(await redis.exists(`sluice:bull:generate:${jobId}`), 'the job still waiting in BullMQ').toBe(1);
        expect(await redis.exists(`sluice:cancelled:${jobId}`), 'no cancel marker').toBe(0);
      } finally {
        thaw(workers);
      }
      const out = empty();
      await read(resumed, out);
      expect(out.errors).toEqual([]);
      expect(out.done).toBe(true);
      expect(out.finishReasons).toEqual({ 0: 'length' });
      expect(out.text).toBe(reference);
    });
  });

  describe('HEAD on the resume URL', () => {
    it('answers what GET would (200, SSE headers, no body) and leaves the live stream where it is', async () => {
      const workers = await ensureWorkers();
      const maxTokens = 800;
      const reference = await textAlone(maxTokens);
      const resumesBefore = await Promise.all([a, b].map((g) => metric(g, 'sluice_gateway_stream_resumes_total', {})));
      // The stream's client stays connected to gateway A throughout (grace 0: a takeover that then
      // left would cancel its work).
      const { res, out, jobId } = await retryMidAnswer('the stream', async () => {
        const controller = new AbortController();
        const res = await post(a.url, '/v1/chat/completions', chatBody(maxTokens), controller.signal);
        const out = empty();
        await read(res, out, (c) => c.text.length > 20);
        const jobId = jobOf(out.id!);
        if ((await freezeMidAnswers(workers, redis, [{ jobId }], maxTokens)) !== null) return { res, out, jobId };
        controller.abort();
        return undefined;
      });
      let rest: Promise<void>;
      try {
        const channel = await redis.hget(metaKey(jobId), 'channel');
        expect(channel).not.toBe('');
        for (const gateway of [a, b]) {
          const head = await fetch(`${gateway.url}/v1/chat/completions/${out.id}?stream=true`, { method: 'HEAD' });
          expect(head.status).toBe(200);
          expect(head.headers.get('content-type')).toMatch(/^text\/event-stream/);
          expect(await head.text()).toBe('');
          // Refusals are the GET's too.
          const unknown = await fetch(`${gateway.url}/v1/chat/completions/chatcmpl-nosuchstream?stream=true`, { method: 'HEAD' });
          expect(unknown.status).toBe(404);
        }
        expect(await redis.hget(metaKey(jobId), 'channel'), 'the stream still routed to gateway A').toBe(channel);
      } finally {
        rest = read(res, out);
        thaw(workers);
      }
      await rest;
      expect(out.errors).toEqual([]);
      expect(out.done).toBe(true);
      expect(out.finishReasons).toEqual({ 0: 'length' });
      expect(out.text).toBe(reference);
      expect(await Promise.all([a, b].map((g) => metric(g, 'sluice_gateway_stream_resumes_total', {})))).toEqual(resumesBefore);
    });
  });

  describe('a completions stream with echo', () => {
    it('writes the echoed prompt again when resumed from the start, and not after a cursor past it', async () => {
      await ensureWorkers();
      const body = {
        model: MODEL,
        prompt: 'Echo me back',
        max_tokens: 6,
        temperature: 0,
        n: 2,
        stream: true,
        ignore_eos: true,
        echo: true,
      };
      const res = await post(a.url, '/v1/completions', body);
      const original = await res.text();
      expect(original).toContain('"text":"Echo me back"');
      const id = /"id":"(cmpl-[^"]+)"/.exec(original)![1]!;
      const texts = (sse: string) => {
        const byChoice: Record<number, string> = {};
        for (const line of sse.split('\n')) {
          if (!line.startsWith('data: {')) continue;
          for (const choice of (JSON.parse(line.slice(6)) as { choices: Array<{ index: number; text: string }> }).choices) {
            byChoice[choice.index] = (byChoice[choice.index] ?? '') + choice.text;
          }
        }
        return byChoice;
      };
      const resumed = await fetch(`${b.url}/v1/completions/${id}?stream=true`);
      expect(resumed.status).toBe(200);
      const replay = texts(await resumed.text());
      expect(replay).toEqual(texts(original));
      for (const text of Object.values(replay)) expect(text.startsWith('Echo me back')).toBe(true);
      const after = await fetch(`${b.url}/v1/completions/${id}?stream=true`, { headers: { 'Last-Event-ID': '0' } });
      expect(await after.text()).not.toContain('Echo me back');
    });
  });

  describe('a completions stream with logprobs', () => {
    it('resumes text_offset where the original stream had it after the cursor, for every choice', async () => {
      await ensureWorkers();
      const body = { model: MODEL, prompt: 'Hello', max_tokens: 10, temperature: 0, n: 2, logprobs: 1, stream: true, ignore_eos: true };
      /** Each choice's (token, text_offset) pairs, in order. */
      const offsets = async (res: Response) => {
        expect(res.status).toBe(200);
        const byChoice: Record<number, Array<[string, number]>> = {};
        for (const item of await collectSse(res.body!)) {
          if (item.kind !== 'data' || item.data === '[DONE]') continue;
          const chunk = JSON.parse(item.data) as {
            choices: Array<{ index: number; logprobs: { tokens: string[]; text_offset: number[] } | null }>;
          };
          for (const { index, logprobs } of chunk.choices) {
            if (logprobs !== null)
              (byChoice[index] ??= []).push(...logprobs.tokens.map((t, k): [string, number] => [t, logprobs.text_offset[k]!]));
          }
        }
        return byChoice;
      };
      const res = await post(a.url, '/v1/completions', body);
      const id = res.headers.get('x-stream-id')!;
      const original = await offsets(res);
      // A cursor halfway through choice 1's deltas in the log (the choices' deltas alternate): both
      // choices have tokens on either side of it.
      const deltas = (await readTokenLog(redis, jobOf(id))).filter((entry) => entry.type === 'text-delta' && entry.index === 1);
      const cursor = deltas[Math.floor(deltas.length / 2)]!.seq;
      for (const resume of [
        () => fetch(`${b.url}/v1/completions/${id}?stream=true`, { headers: { 'Last-Event-ID': String(cursor) } }),
        () => fetch(`${b.url}/v1/completions/${id}?stream=true&starting_after=${cursor}`),
      ]) {
        const resumed = await offsets(await resume());
        for (const index of [0, 1]) {
          const all = original[index]!;
          const rest = resumed[index]!;
          expect(rest.length, `choice ${index}`).toBeGreaterThan(0);
          expect(rest.length, `choice ${index}`).toBeLessThan(all.length);
          expect(rest, `choice ${index}`).toEqual(all.slice(all.length - rest.length));
        }
      }
    });
  });

  describe('a completions request with a batch of prompts', () => {
    it('refuses a resume with a 400 that says a batch is not resumable (GET and HEAD)', async () => {
      await ensureWorkers();
      const out = await collect(
        await post(a.url, '/v1/completions', { model: MODEL, prompt: ['a', 'b', 'c'], max_tokens: 3, stream: true, ignore_eos: true }),
      );
      expect(out.done).toBe(true);
      for (const gateway of [a, b]) {
        const res = await fetch(`${gateway.url}/v1/completions/${out.id}?stream=true`);
        expect(res.status).toBe(400);
        const body = (await res.json()) as { error: { message: string; type: string; param: string | null; code: string } };
        expect(body.error).toMatchObject({ type: 'invalid_request_error', param: 'id', code: 'invalid_request' });
        expect(body.error.message).toMatch(/batch of 3 prompts/);
        const head = await fetch(`${gateway.url}/v1/completions/${out.id}?stream=true`, { method: 'HEAD' });
        expect(head.status).toBe(400);
      }
    });

    it('is cancelled whole by its id: every prompt ends with finish_reason abort', async () => {
      const workers = await ensureWorkers();
      const maxTokens = 1500;
      const { res, out, jobId } = await retryMidAnswer('the batch', async () => {
        const controller = new AbortController();
        const res = await post(
          a.url,
          '/v1/completions',
          { model: MODEL, prompt: ['a', 'b'], max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream: true },
          controller.signal,
        );
        const out = empty();
        await read(res, out, (c) => c.text.length > 5);
        const jobId = jobOf(out.id!);
        const prompts = [{ jobId }, { jobId: batchRequestId(jobId, 1) }];
        if ((await freezeMidAnswers(workers, redis, prompts, maxTokens)) !== null) return { res, out, jobId };
        controller.abort();
        return undefined;
      });
      let rest: Promise<void>;
      try {
        // From the other gateway, as any client may.
        const cancel = await fetch(`${b.url}/v1/completions/${out.id}/cancel`, { method: 'POST' });
        expect(cancel.status).toBe(200);
        expect(await cancel.json()).toMatchObject({ cancelled: true });
      } finally {
        rest = read(res, out);
        thaw(workers);
      }
      await rest;
      expect(out.errors).toEqual([]);
      expect(out.done).toBe(true);
      expect(out.finishReasons).toEqual({ 0: 'abort', 1: 'abort' });
      // Neither prompt goes on decoding on a worker.
      for (const id of [jobId, batchRequestId(jobId, 1)]) {
        expect(await unfinishedInLog(redis, id, Infinity), `${id} ended in its log`).toBe(false);
      }
      await waitFor('the workers idle', async () =>
        (await Promise.all(workers.map((w) => w.health()))).every((h) => h.running === 0) ? true : undefined,
      );
    });
  });
});
