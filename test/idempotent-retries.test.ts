import { createHash } from 'node:crypto';
import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { encodeRequestMeta, redisNames } from '@sluice/protocol';
import { createKey } from './support/api-keys.js';
import { Cluster, MODEL } from './support/cluster.js';
import { freeze, retryMidAnswer, thaw, unfinishedInLog } from './support/mid-answer.js';
import { startNginx, type NginxServer } from './support/nginx.js';
import { waitFor } from './support/processes.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { checkChunkSequence, collectSse } from './support/sse.js';
import { loggedAnswer, readTokenLog } from './support/token-log.js';

/**
 * nginx sends a request to the next gateway when the one it reached closes the connection before the
 * reply's headers (`proxy_next_upstream error … non_idempotent`): a gateway killed after it enqueued a
 * POST made the retry generate the answer a second time and charge the API key twice (a `--rpm 1`
 * key's only request was answered 429). The retry now carries the same Idempotency-Key (nginx's
 * `$request_id`, deploy/nginx/sluice-proxy.conf) and the next gateway delivers the request already
 * admitted. Real nginx, redis-server, gateway and worker processes (tiny model); the worker frozen
 * with SIGSTOP so that the request is still waiting when its gateway is killed with SIGKILL.
 */
const names = redisNames('sluice');
const MAX_TOKENS = 40;

describe('a POST retried after its gateway died, through nginx', () => {
  let cluster: Cluster;
  let redis: Redis;
  let worker: WorkerProcess;
  let nginx: NginxServer;
  const gateways = new Map<string, GatewayProcess>();

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the frozen worker must not look lost.
    worker = await cluster.worker({ WORKER_TTL_MS: '60000' });
    redis = cluster.redis.client();
    // Headers held until the first token: a killed gateway's stream has sent nothing, so nginx retries it.
    const env = { AUTH: 'keys', HEADERS_WAIT_MS: '60000' };
    for (const id of ['gw-a', 'gw-b', 'gw-c']) gateways.set(id, await cluster.gateway({ ...env, GATEWAY_ID: id }));
    nginx = await startNginx({ upstreamPorts: [...gateways.values()].map((g) => Number(new URL(g.url).port)) });
  });

  afterAll(async () => {
    thaw([worker]);
    redis?.disconnect();
    await nginx?.close();
    await cluster?.stop();
  });

  /** Which gateway holds the one request waiting in the queue (its job added), and the request's id. */
  async function waitingRequest(): Promise<{ jobId: string; gatewayId: string }> {
    return waitFor('the request enqueued', async () => {
      const metas = await redis.keys('sluice:{*}:meta');
      const fresh = [];
      for (const key of metas) {
        const jobId = key.slice('sluice:{'.length, -'}:meta'.length);
        // (The meta goes out just before the job: a gateway killed between them leaves no job to replay.)
        if ((await redis.exists(names.logKey(jobId))) === 0 && (await redis.exists(`sluice:bull:generate:${jobId}`)) === 1)
          fresh.push(jobId);
      }
      if (fresh.length !== 1) return undefined;
      const jobId = fresh[0]!;
      const channel = (await redis.hget(names.metaKey(jobId), 'channel')) ?? '';
      const gatewayId = [...gateways.keys()].find((id) => channel.startsWith(`${names.gatewayChannel(id)}.`));
      return gatewayId === undefined ? undefined : { jobId, gatewayId };
    });
  }

  /** Sends `body` through nginx with the worker frozen, kills the gateway that enqueued it, thaws the worker. */
  async function postAcrossAKill(key: string, body: object): Promise<{ res: Response; jobId: string; killed: string }> {
    const metasBefore = (await redis.keys('sluice:{*}:meta')).length;
    await freeze([worker]);
    let reply: Promise<Response>;
    let request: { jobId: string; gatewayId: string };
    try {
      reply = fetch(`${nginx.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` },
        body: JSON.stringify(body),
      });
      let answered: Response | undefined;
      void reply.then((res) => (answered = res));
      request = await waitingRequest();
      const { jobId, gatewayId } = request;
      const killed = gateways.get(gatewayId)!;
      gateways.delete(gatewayId);
      killed.process.signal('SIGKILL');
      await killed.process.exited;
      // nginx has passed the request on: the next gateway took the request over (its route names that
      // gateway's channel), or admitted it as a second request, or refused it (what it did before).
      const retried = await waitFor('the retry', async () => {
        const channel = (await redis.hget(names.metaKey(jobId), 'channel')) ?? '';
        if (!channel.startsWith(`${names.gatewayChannel(gatewayId)}.`)) return 'taken over';
        // (A `--rpm 1` key's retry was refused at once: 429.)
        if (answered !== undefined) return `answered ${answered.status} with the worker frozen`;
        return (await redis.keys('sluice:{*}:meta')).length > metasBefore + 1 ? 'admitted again' : undefined;
      });
      expect(retried).toBe('taken over');
    } finally {
      thaw([worker]);
    }
    return { res: await reply, jobId: request.jobId, killed: request.gatewayId };
  }

  // (First: the tests below each kill a gateway.)
  it('streams the whole answer to both of two POSTs with one Idempotency-Key on two gateways, the first still connected', async () => {
    const key = await createKey(cluster.redis.url, ['--name', 'sent-twice']);
    const body = {
      model: MODEL,
      stream: true,
      max_tokens: MAX_TOKENS,
      temperature: 0,
      ignore_eos: true,
      messages: [{ role: 'user', content: 'Say it twice.' }],
    };
    const [first, second] = [gateways.get('gw-a')!, gateways.get('gw-b')!];
    const post = (gateway: GatewayProcess) =>
      fetch(`${gateway.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${key}`, 'idempotency-key': 'twice-1' },
        body: JSON.stringify(body),
      });
    // The worker frozen: the request waits in the queue while the second POST takes its delivery over,
    // and the worker then sends every entry to the second gateway.
    await freeze([worker]);
    let replies: [Promise<Response>, Promise<Response>];
    let jobId: string;
    try {
      const firstReply = post(first);
      ({ jobId } = await waitingRequest());
      const secondReply = post(second);
      await waitFor('the delivery taken over', async () =>
        ((await redis.hget(names.metaKey(jobId), 'channel')) ?? '').startsWith(`${names.gatewayChannel('gw-b')}.`) ? true : undefined,
      );
      replies = [firstReply, secondReply];
    } finally {
      thaw([worker]);
    }
    // The first connection is not told of the move: it reads the answer from the log (before, it got
    // nothing more and ended with queue_timeout).
    const streams = await Promise.all(
      replies.map(async (reply) => {
        const res = await reply;
        expect(res.status).toBe(200);
        return checkChunkSequence(await collectSse(res.body!), 'chat', false);
      }),
    );
    const logged = (await loggedAnswer(redis, jobId)).text;
    for (const stream of streams) {
      expect(stream.finishReason).toBe('length');
      expect(stream.text).toBe(logged);
    }
    expect((await readTokenLog(redis, jobId)).filter((e) => e.type === 'accepted')).toHaveLength(1);
  });

  it('answers a non-streaming request once, from the request the dead gateway admitted, and charges the key once', async () => {
    const key = await createKey(cluster.redis.url, ['--name', 'retried', '--rpm', '1']);
    const before = (await worker.health()).processed;
    const body = {
      model: MODEL,
      max_tokens: MAX_TOKENS,
      temperature: 0,
      ignore_eos: true,
      messages: [{ role: 'user', content: 'Say hi.' }],
    };
    const { res, jobId } = await postAcrossAKill(key, body);
    const text = await res.text();
    expect(res.status, `${text}\n${await nginx.accessLog()}`).toBe(200);
    const reply = JSON.parse(text) as {
      id: string;
      choices: Array<{ message: { content: string } }>;
      usage: { completion_tokens: number };
    };
    expect(reply.id).toBe(`chatcmpl-${jobId}`);
    expect(reply.usage.completion_tokens).toBe(MAX_TOKENS);
    expect(reply.choices[0]!.message.content).toBe((await loggedAnswer(redis, jobId)).text);
    // One generation: one job taken by the worker, one `accepted` in the log.
    await waitFor('the worker done', async () => ((await worker.health()).processed === before + 1 ? true : undefined));
    expect((await readTokenLog(redis, jobId)).filter((e) => e.type === 'accepted')).toHaveLength(1);
    // nginx tried two gateways: the killed one (no reply: 502) and the one that answered.
    expect(await nginx.accessLog()).toMatch(/upstream_status=502, 200/);
  });

  it('streams the answer once after the gateway holding the stream died before its headers', async () => {
    const key = await createKey(cluster.redis.url, ['--name', 'streamed', '--rpm', '1']);
    const before = (await worker.health()).processed;
    const body = {
      model: MODEL,
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: MAX_TOKENS,
      temperature: 0,
      ignore_eos: true,
      messages: [{ role: 'user', content: 'Say hello.' }],
    };
    const { res, jobId } = await postAcrossAKill(key, body);
    expect(res.status).toBe(200);
    const items = await collectSse(res.body!);
    const stream = checkChunkSequence(items, 'chat', true);
    expect(stream.finishReason).toBe('length');
    expect(stream.usage?.completion_tokens).toBe(MAX_TOKENS);
    expect(stream.text).toBe((await loggedAnswer(redis, jobId)).text);
    expect(items.some((i) => i.kind === 'data' && i.data.includes(`"id":"chatcmpl-${jobId}"`))).toBe(true);
    await waitFor('the worker done', async () => ((await worker.health()).processed === before + 1 ? true : undefined));
  });
});

describe('Idempotency-Key on one gateway', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let redis: Redis;
  let worker: WorkerProcess;
  let key: string;
  /** A key without limits, for the long answers. */
  let unlimited: string;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // The meta (and log) kept 3 s after a request ends; a frozen worker not taken for lost.
    worker = await cluster.worker({ STREAM_RETENTION_MS: '3000', WORKER_TTL_MS: '60000' });
    gateway = await cluster.gateway({ AUTH: 'keys', QUEUE_TIMEOUT_MS: '1500', MAX_QUEUED_REQUESTS: '1' });
    redis = cluster.redis.client();
    key = await createKey(cluster.redis.url, ['--name', 'orders', '--tpm', '200']);
    unlimited = await createKey(cluster.redis.url, ['--name', 'unlimited']);
  });

  afterAll(async () => {
    thaw([worker]);
    redis?.disconnect();
    await cluster?.stop();
  });

  const post = (body: object, idempotencyKey?: string, path = '/v1/completions', apiKey = key) =>
    fetch(`${gateway.url}${path}`, {
      method: 'POST',
      headers: {
        'content-type': 'application/json',
        authorization: `Bearer ${apiKey}`,
        ...(idempotencyKey === undefined ? {} : { 'idempotency-key': idempotencyKey }),
      },
      body: JSON.stringify(body),
    });
  const completion = { model: MODEL, prompt: 'Once upon a time', max_tokens: 12, temperature: 1, seed: 7, ignore_eos: true };
  /** The job id of the request whose meta is not among `earlier` once its log has text. */
  const firstRunning = (earlier: ReadonlySet<string>) =>
    waitFor(
      'the first request running',
      async () => {
        for (const metaKey of await redis.keys('sluice:{*}:meta')) {
          const id = metaKey.slice('sluice:{'.length, -'}:meta'.length);
          if (!earlier.has(metaKey) && (await readTokenLog(redis, id)).some((e) => e.type === 'text-delta')) return id;
        }
        return undefined;
      },
      20_000,
      5,
    );

  it('answers the same request again, without running it again, when the same key and body come back', async () => {
    const first = await post(completion, 'order-1');
    expect(first.status).toBe(200);
    const firstBody = (await first.json()) as { id: string; choices: Array<{ text: string }> };
    const again = await post(completion, 'order-1');
    expect(again.status).toBe(200);
    const againBody = (await again.json()) as { id: string; choices: Array<{ text: string }> };
    expect(againBody).toEqual(firstBody);
    const replays = (await (await fetch(`${gateway.url}/metrics`)).text()).match(
      /^sluice_gateway_request_replays_total\{stream="false"\} (\d+)/m,
    );
    expect(replays?.[1]).toBe('1');
    // One job: the first reply's id is the only request the log knows.
    const jobId = firstBody.id.slice('cmpl-'.length);
    expect((await readTokenLog(redis, jobId)).filter((e) => e.type === 'accepted')).toHaveLength(1);
  });

  it('refuses the key with another body (422) or route, and a malformed key (400)', async () => {
    expect((await post(completion, 'order-2')).status).toBe(200);
    const other = await post({ ...completion, max_tokens: 3 }, 'order-2');
    expect(other.status).toBe(422);
    expect(await other.json()).toMatchObject({ error: { code: 'idempotency_key_reused' } });
    const chat = await post({ model: MODEL, max_tokens: 3, messages: [{ role: 'user', content: 'x' }] }, 'order-2', '/v1/chat/completions');
    expect(chat.status).toBe(422);
    for (const bad of ['', 'a b', 'x'.repeat(256), 'caf\u00e9']) {
      const res = await fetch(`${gateway.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${key}`, 'idempotency-key': bad },
        body: JSON.stringify(completion),
      }).catch(() => undefined);
      // (fetch itself refuses a non-ASCII header value: nothing reaches the gateway.)
      if (res === undefined) continue;
      expect(res.status, JSON.stringify(bad)).toBe(400);
      expect(await res.json()).toMatchObject({ error: { param: 'Idempotency-Key' } });
    }
  });

  it('frees the key of a request its API key refused, and answers 409 while a claim names no request yet', async () => {
    // Over the key's 200 tokens per minute: refused after the Idempotency-Key was claimed.
    const refused = await post({ ...completion, max_tokens: 400 }, 'order-3');
    expect(refused.status).toBe(400);
    expect(await refused.json()).toMatchObject({ error: { code: 'tokens_over_key_limit' } });
    // Another body under the same key: admitted afresh, not refused as a reuse.
    expect((await post(completion, 'order-3')).status).toBe(200);
    // A claim as a gateway makes it before enqueueing (one that died right then leaves it so).
    const owner = createHash('sha256').update(key).digest('hex');
    const record = names.idempotencyKey(createHash('sha256').update(`${owner}\norder-4`).digest('base64url'));
    const digest = createHash('sha256')
      .update(`completion\n${JSON.stringify(completion)}`)
      .digest('base64url');
    await redis.set(record, `no-such-request ${digest}`, 'PX', 30_000);
    const pending = await post(completion, 'order-4');
    expect(pending.status).toBe(409);
    expect(pending.headers.get('retry-after')).not.toBeNull();
    expect(await pending.json()).toMatchObject({ error: { code: 'idempotency_conflict' } });
  });

  it('admits a retry afresh when the request its key names left no answer: timed out in the queue, or expired', async () => {
    // Timed out waiting for a worker (frozen): 503 queue_timeout, its log ended `abort`.
    await freeze([worker]);
    let timedOut: Response;
    try {
      timedOut = await post(completion, 'order-5', '/v1/completions', unlimited);
    } finally {
      thaw([worker]);
    }
    expect(timedOut.status).toBe(503);
    expect(await timedOut.json()).toMatchObject({ error: { code: 'queue_timeout' } });
    const retried = await post(completion, 'order-5', '/v1/completions', unlimited);
    expect(retried.status).toBe(200);
    const answer = (await retried.json()) as {
      id: string;
      choices: Array<{ finish_reason: string }>;
      usage: { completion_tokens: number };
    };
    expect(answer.choices[0]!.finish_reason).toBe('length');
    expect(answer.usage.completion_tokens).toBe(completion.max_tokens);
    // Its meta gone (3 s after its end) while its key is kept for the request's deadline: a retry is a
    // new request (it was answered 409 "being admitted" until the key lapsed).
    const jobId = answer.id.slice('cmpl-'.length);
    await waitFor('the meta expired', async () => ((await redis.exists(names.metaKey(jobId))) === 0 ? true : undefined), 20_000);
    const afterExpiry = await post(completion, 'order-5', '/v1/completions', unlimited);
    expect(afterExpiry.status).toBe(200);
    const again = (await afterExpiry.json()) as { id: string; choices: Array<{ text: string }> };
    expect(again.id).not.toBe(answer.id);
  });

  it('takes no place in the queue for a replay that waits for its answer (MAX_QUEUED_REQUESTS=1)', async () => {
    const long = { model: MODEL, prompt: 'Tell a long story.', max_tokens: 1500, ignore_eos: true };
    // The first request frozen mid-answer (the worker stopped): the replay below waits for the rest.
    const { first, jobId, idemKey } = await retryMidAnswer('a completion', async (n) => {
      const idemKey = `order-6.${n}`;
      const earlier = new Set(await redis.keys('sluice:{*}:meta'));
      const first = post(long, idemKey, '/v1/completions', unlimited);
      const jobId = await firstRunning(earlier);
      await freeze([worker]);
      if (await unfinishedInLog(redis, jobId, long.max_tokens)) return { first, jobId, idemKey };
      thaw([worker]);
      await first;
      return undefined;
    });
    try {
      const tokensWritten = async () =>
        Number((await (await fetch(`${gateway.url}/metrics`)).text()).match(/^sluice_gateway_stream_tokens_total (\d+)/m)?.[1]);
      const before = await tokensWritten();
      const replay = post(long, idemKey, '/v1/completions', unlimited);
      // The replay took the delivery over (the first connection ends with stream_interrupted).
      expect((await first).status).toBe(502);
      // It has read its log's first entries (its `accepted`, then the tokens so far): it counts as
      // queued only until its `accepted`, as any request does.
      await waitFor('the replay reading its log', async () => ((await tokensWritten()) > before ? true : undefined));
      // An unrelated request still finds the queue's one place free (it waits there: the worker is frozen).
      const other = new AbortController();
      const unrelated = fetch(`${gateway.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${unlimited}` },
        body: JSON.stringify(completion),
        signal: other.signal,
      }).then(
        (res) => res.status,
        () => 'aborted',
      );
      const early = await Promise.race([unrelated, new Promise((resolve) => setTimeout(() => resolve('waiting'), 500))]);
      expect(early).toBe('waiting');
      other.abort();
      thaw([worker]);
      const replayed = await replay;
      expect(replayed.status).toBe(200);
      expect(((await replayed.json()) as { id: string }).id).toBe(`cmpl-${jobId}`);
    } finally {
      thaw([worker]);
    }
  });

  it('admits a retry afresh when its client left the request running, before the abort of that request reached its log', async () => {
    const long = { model: MODEL, prompt: 'Tell another long story.', max_tokens: 1500, ignore_eos: true };
    const { first, jobId, idemKey, client } = await retryMidAnswer('a completion', async (n) => {
      const idemKey = `order-8.${n}`;
      const earlier = new Set(await redis.keys('sluice:{*}:meta'));
      const client = new AbortController();
      const first = fetch(`${gateway.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${unlimited}`, 'idempotency-key': idemKey },
        body: JSON.stringify(long),
        signal: client.signal,
      }).then(
        (res) => res.status,
        () => 'aborted',
      );
      const jobId = await firstRunning(earlier);
      await freeze([worker]);
      if (await unfinishedInLog(redis, jobId, long.max_tokens)) return { first, jobId, idemKey, client };
      thaw([worker]);
      await first;
      return undefined;
    });
    try {
      // The client leaves (no resume grace): the gateway cancels the request, whose worker is frozen, so
      // its `abort` cannot reach the log before the retry is decided.
      client.abort();
      expect(await first).toBe('aborted');
      await waitFor('the cancel sent', async () => ((await redis.exists(names.cancelMarkerKey(jobId))) === 1 ? true : undefined));
      const metas = new Set(await redis.keys('sluice:{*}:meta'));
      const replays = async () =>
        Number(
          (await (await fetch(`${gateway.url}/metrics`)).text()).match(
            /^sluice_gateway_request_replays_total\{stream="false"\} (\d+)/m,
          )?.[1] ?? 0,
        );
      const replaysBefore = await replays();
      const retry = post(long, idemKey, '/v1/completions', unlimited);
      // Decided while the worker is frozen: a new request (its meta) or a replay of the cancelled one.
      await waitFor('the retry admitted or replayed', async () =>
        (await redis.keys('sluice:{*}:meta')).some((key) => !metas.has(key)) || (await replays()) > replaysBefore ? true : undefined,
      );
      thaw([worker]);
      const res = await retry;
      expect(res.status).toBe(200);
      const answer = (await res.json()) as { id: string; choices: Array<{ finish_reason: string }> };
      // Before: the retry replayed the cancelled request and got its `abort`.
      expect(answer.id).not.toBe(`cmpl-${jobId}`);
      expect(answer.choices[0]!.finish_reason).toBe('length');
    } finally {
      thaw([worker]);
    }
  });

  it('admits a retry afresh when the request its key names has no job and nothing logged: its gateway died before the add, or a cancel removed the job', async () => {
    // What such a gateway leaves: the key claimed (not kept), the meta, no job and no log.
    const owner = createHash('sha256').update(unlimited).digest('hex');
    const record = names.idempotencyKey(createHash('sha256').update(`${owner}\norder-7`).digest('base64url'));
    const digest = createHash('sha256')
      .update(`completion\n${JSON.stringify(completion)}`)
      .digest('base64url');
    const orphan = 'orphan-request';
    await redis.set(record, `${orphan} ${digest}`, 'PX', 30_000);
    const format = {
      endpoint: 'completion' as const,
      model: MODEL,
      created: 1,
      includeUsage: false,
      n: 1,
      maxTokensParam: 'max_tokens' as const,
    };
    const now = Date.now();
    await redis.hset(
      names.metaKey(orphan),
      encodeRequestMeta({ channel: 'sluice:gw:gone.0', graceMs: 0, attempt: 1, enqueuedAt: now, deadlineAt: now + 60_000, format, owner }),
    );
    const res = await post(completion, 'order-7', '/v1/completions', unlimited);
    expect(res.status).toBe(200);
    const answer = (await res.json()) as { id: string; usage: { completion_tokens: number } };
    expect(answer.id).not.toBe(`cmpl-${orphan}`);
    expect(answer.usage.completion_tokens).toBe(completion.max_tokens);
    // What a queue timeout leaves for a moment after its 503: the key kept, the meta, the job removed and
    // the log's `abort` ending not written yet (CI once saw the retry replay it and answer 200 `abort`).
    const removed = 'removed-request';
    await redis.set(record, `${removed} ${digest} kept`, 'PX', 60_000);
    await redis.hset(
      names.metaKey(removed),
      encodeRequestMeta({ channel: 'sluice:gw:gone.0', graceMs: 0, attempt: 1, enqueuedAt: now, deadlineAt: now + 60_000, format, owner }),
    );
    const retried = await post(completion, 'order-7', '/v1/completions', unlimited);
    expect(retried.status).toBe(200);
    const fresh = (await retried.json()) as { id: string; choices: Array<{ finish_reason: string }> };
    expect(fresh.id).not.toBe(`cmpl-${removed}`);
    expect(fresh.choices[0]!.finish_reason).toBe('length');
  });
});
