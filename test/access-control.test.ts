import { createServer, type Server } from 'node:http';
import { connect } from 'node:net';
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Browser } from 'playwright-core';
import { createKey, runKeys } from './support/api-keys.js';
import { hasChromium, launchChromium } from './support/chromium.js';
import { Cluster, MODEL } from './support/cluster.js';
import { freePort, sleep, startProcess, waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import { GATEWAY_MAIN, type GatewayProcess, type WorkerProcess } from './support/sluice.js';
import { hashApiKey } from '../apps/gateway/src/auth/api-key.js';

/**
 * Access control with the real processes: one redis-server, one worker (tiny model), two gateways
 * with AUTH=keys sharing the keys and the limits, keys made with the `keys` command, the official
 * `openai` client, and a real headless Chromium for CORS.
 */

const chat = (content: string, maxTokens: number, extra: Record<string, unknown> = {}) => ({
  model: MODEL,
  messages: [{ role: 'user' as const, content }],
  max_tokens: maxTokens,
  temperature: 0,
  ...extra,
});

describe('access control across two gateways', () => {
  let cluster: Cluster;
  let worker: WorkerProcess;
  const gateways: GatewayProcess[] = [];
  let pages: Server;
  let allowedOrigin: string;
  let otherOrigin: string;

  const client = (gateway: GatewayProcess, apiKey: string) =>
    new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey, maxRetries: 0, timeout: 30_000 });
  const post = (gateway: GatewayProcess, key: string | undefined, body: unknown, headers: Record<string, string> = {}) =>
    fetch(`${gateway.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', ...(key === undefined ? {} : { Authorization: `Bearer ${key}` }), ...headers },
      body: JSON.stringify(body),
    });
  const keys = (...args: string[]) => createKey(cluster.redis.url, args);

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the tests freeze the worker with SIGSTOP while admissions are decided.
    worker = await cluster.worker({ WORKER_TTL_MS: '30000' });
    const [pagePort, otherPort] = [await freePort(), await freePort()];
    allowedOrigin = `http://127.0.0.1:${pagePort}`;
    otherOrigin = `http://127.0.0.1:${otherPort}`;
    const env = { AUTH: 'keys', CORS_ORIGINS: `${allowedOrigin},https://example.test`, HEADERS_WAIT_MS: '200' };
    gateways.push(...(await Promise.all([cluster.gateway(env), cluster.gateway(env)])));
    // A blank page on two origins: one allowed, one not.
    pages = createServer((_req, res) => res.writeHead(200, { 'Content-Type': 'text/html' }).end('<!doctype html><title>page</title>'));
    await new Promise<void>((resolve) => pages.listen(pagePort, '127.0.0.1', () => resolve()));
    const other = createServer((_req, res) =>
      res.writeHead(200, { 'Content-Type': 'text/html' }).end('<!doctype html><title>other</title>'),
    );
    await new Promise<void>((resolve) => other.listen(otherPort, '127.0.0.1', () => resolve()));
    pages.once('close', () => other.close());
  }, 180_000);

  afterAll(async () => {
    worker?.process.signal('SIGCONT');
    pages?.close();
    await cluster?.stop();
  });

  describe('API keys', () => {
    it('refuses no key, a wrong key and a revoked key with 401 on both gateways, with the OpenAI error body', async () => {
      const key = await keys('--name', 'revocable');
      expect(key).toMatch(/^sk-sluice-[\w-]{43}$/);
      for (const gateway of gateways) {
        const none = await post(gateway, undefined, chat('hi', 2));
        expect(none.status).toBe(401);
        expect(await none.json()).toMatchObject({ error: { type: 'invalid_request_error', code: 'invalid_api_key' } });
        await expect(client(gateway, 'sk-sluice-wrong').chat.completions.create(chat('hi', 2))).rejects.toBeInstanceOf(
          OpenAI.AuthenticationError,
        );
        const ok = await client(gateway, key).chat.completions.create(chat('hi', 2));
        expect(ok.choices[0]?.finish_reason).toMatch(/stop|length/);
        // x-api-key works too.
        expect((await post(gateway, undefined, chat('hi', 2), { 'x-api-key': key })).status).toBe(200);
        // Resume and cancel by id are behind the key as well (an unknown id is then a 404).
        const cancel = (headers: Record<string, string>) =>
          fetch(`${gateway.url}/v1/chat/completions/chatcmpl-unknown/cancel`, { method: 'POST', headers });
        expect((await cancel({})).status).toBe(401);
        expect((await cancel({ Authorization: `Bearer ${key}` })).status).toBe(404);
        expect((await fetch(`${gateway.url}/v1/chat/completions/chatcmpl-unknown?stream=true`)).status).toBe(401);
      }
      const revoked = await runKeys(cluster.redis.url, ['revoke', '--name', 'revocable']);
      expect(revoked.code).toBe(0);
      for (const gateway of gateways) {
        const error = await client(gateway, key)
          .chat.completions.create(chat('hi', 2))
          .catch((e: unknown) => e);
        expect(error).toBeInstanceOf(OpenAI.AuthenticationError);
        expect((error as InstanceType<typeof OpenAI.AuthenticationError>).code).toBe('invalid_api_key');
        expect(
          (await client(gateway, key)
            .models.list()
            .catch((e: unknown) => e)) as object,
        ).toBeInstanceOf(OpenAI.AuthenticationError);
      }
    });

    it('lets only the key that made a request resume or cancel it, on either gateway (another key gets 404)', async () => {
      const [owner, stranger] = await Promise.all([keys('--name', 'owner'), keys('--name', 'stranger')]);
      const stream = await client(gateways[0]!, owner).chat.completions.create({ ...chat('mine', 4), stream: true });
      let id = '';
      for await (const chunk of stream) id = chunk.id;
      expect(id).toMatch(/^chatcmpl-/);
      const steer = (gateway: GatewayProcess, key: string, path: string, method: 'GET' | 'POST') =>
        fetch(`${gateway.url}/v1/chat/completions/${id}${path}`, { method, headers: { Authorization: `Bearer ${key}` } });
      for (const gateway of gateways) {
        const resumed = await steer(gateway, stranger, '?stream=true', 'GET');
        expect(resumed.status).toBe(404);
        expect(((await resumed.json()) as { error: { code: string } }).error.code).toBe('not_found');
        expect((await steer(gateway, stranger, '/cancel', 'POST')).status).toBe(404);
      }
      // The owner reads the whole stream again from the log, from the other gateway.
      const own = await steer(gateways[1]!, owner, '?stream=true', 'GET');
      expect(own.status).toBe(200);
      expect(await own.text()).toContain('data: [DONE]');
    });

    it('refuses a key for no model and a stray argument, with the usage (exit 2)', async () => {
      const none = await runKeys(cluster.redis.url, ['create', '--name', 'no-models', '--models', ' , ']);
      expect(none.code).toBe(2);
      expect(none.stderr).toMatch(/--models needs at least one model id/);
      const stray = await runKeys(cluster.redis.url, ['revoke', 'extra', '--name', 'no-models']);
      expect(stray.code).toBe(2);
      expect(stray.stderr).toMatch(/unexpected argument "extra"/);
      expect((await runKeys(cluster.redis.url, ['list'])).stdout).not.toMatch(/^no-models\t/m);
    });

    it('refuses a limit that is not plain decimal digits, with the usage (exit 2)', async () => {
      // Number() took each of these (1000, 16, 5).
      for (const value of ['1e3', '0x10', ' 5']) {
        const result = await runKeys(cluster.redis.url, ['create', '--name', 'odd-limit', '--rpm', value]);
        expect(result.code, value).toBe(2);
        expect(result.stderr).toContain(`--rpm must be a positive integer (got "${value}")`);
      }
      expect((await runKeys(cluster.redis.url, ['list'])).stdout).not.toMatch(/^odd-limit\t/m);
    });

    it('lists keys by name and limits, never the key itself', async () => {
      const key = await keys('--name', 'listed', '--rpm', '5', '--tpm', '1000', '--max-streams', '2', '--models', `${MODEL},other`);
      const list = await runKeys(cluster.redis.url, ['list']);
      expect(list.stdout).toMatch(/^listed\trpm=5 tpm=1000 max-streams=2\tmodels=.*,other\t/m);
      expect(list.stdout).not.toContain(key);
      const redis = cluster.redis.client();
      const stored = await redis.hgetall('sluice:apikeys').finally(() => redis.disconnect());
      expect(JSON.stringify(stored)).not.toContain(key);
      expect(Object.keys(stored)).toContain(hashApiKey(key));
    });

    it('refuses a model the key may not use with 403, and serves the one it may', async () => {
      const key = await keys('--name', 'one-model', '--models', 'some-other-model');
      const error = await client(gateways[0]!, key)
        .chat.completions.create(chat('hi', 2))
        .catch((e: unknown) => e);
      expect(error).toBeInstanceOf(OpenAI.PermissionDeniedError);
      expect((error as InstanceType<typeof OpenAI.PermissionDeniedError>).code).toBe('model_not_allowed');
      const allowed = await keys('--name', 'this-model', '--models', MODEL);
      expect((await client(gateways[1]!, allowed).chat.completions.create(chat('hi', 2))).choices).toHaveLength(1);
    });
  });

  describe('per-key limits, shared by both gateways', () => {
    it('admits exactly 10 of 40 concurrent requests on a --rpm 10 key, spread over both gateways; the rest get 429 with Retry-After', async () => {
      const key = await keys('--name', 'rpm10', '--rpm', '10');
      const replies = await Promise.all(
        Array.from({ length: 40 }, async (_, i) => {
          const res = await post(gateways[i % 2]!, key, chat(`request ${i}`, 1));
          return { status: res.status, headers: res.headers, body: (await res.json()) as { error?: { code: string; type: string } } };
        }),
      );
      const admitted = replies.filter((r) => r.status === 200);
      const limited = replies.filter((r) => r.status === 429);
      expect(admitted).toHaveLength(10);
      expect(limited).toHaveLength(30);
      // Each admission saw its own count: remaining 9, 8, ..., 0, whichever gateway decided it.
      expect(admitted.map((r) => Number(r.headers.get('x-ratelimit-remaining-requests'))).sort((a, b) => a - b)).toEqual([
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
      ]);
      for (const r of replies) {
        expect(r.headers.get('x-ratelimit-limit-requests')).toBe('10');
        expect(r.headers.get('x-ratelimit-reset-requests')).toMatch(/^(\d+ms|\d+(\.\d+)?s|\d+m\d+(\.\d+)?s)$/);
        expect(r.headers.get('x-ratelimit-limit-tokens')).toBeNull();
      }
      for (const r of limited) {
        expect(r.body.error).toMatchObject({ code: 'rate_limit_exceeded', type: 'rate_limit_error' });
        expect(r.headers.get('x-ratelimit-remaining-requests')).toBe('0');
        const retryAfter = Number(r.headers.get('retry-after'));
        expect(retryAfter).toBeGreaterThanOrEqual(1);
        expect(retryAfter).toBeLessThanOrEqual(60);
      }
      // The official client sees a RateLimitError.
      const error = await client(gateways[1]!, key)
        .chat.completions.create(chat('one more', 1))
        .catch((e: unknown) => e);
      expect(error).toBeInstanceOf(OpenAI.RateLimitError);
      const metrics = await Promise.all(gateways.map((g) => scrapePrometheus(`${g.url}/metrics`)));
      expect(metrics.reduce((sum, m) => sum + m.value('sluice_gateway_key_requests_total', { key: 'rpm10' }), 0)).toBe(10);
      expect(metrics.reduce((sum, m) => sum + m.value('sluice_gateway_key_refusals_total', { key: 'rpm10', reason: 'requests' }), 0)).toBe(
        31,
      );
    });

    it('never reserves more tokens than a --tpm budget for concurrent streams, and settles to the tokens actually streamed', async () => {
      const content = 'Tell me a story about a lighthouse.';
      const maxTokens = 24;
      // The reservation of one such request, read off a key with a large budget: the exact prompt
      // tokens (the gateway tokenizes) + max_tokens.
      const probe = await post(gateways[0]!, await keys('--name', 'tpm-probe', '--tpm', '1000000'), chat(content, maxTokens));
      const reservation = 1_000_000 - Number(probe.headers.get('x-ratelimit-remaining-tokens'));
      const probeUsage = ((await probe.json()) as { usage: { prompt_tokens: number } }).usage;
      expect(reservation).toBe(probeUsage.prompt_tokens + maxTokens);
      // Room for 3 such requests and a bit: the 4th never fits while they run.
      const budget = 3 * reservation + probeUsage.prompt_tokens + 5;
      const key = await keys('--name', 'tpm', '--tpm', String(budget));
      const openai = gateways.map((g) => client(g, key));

      // Frozen worker: no request can end (and give tokens back) while the admissions are decided.
      worker.process.signal('SIGSTOP');
      let streams;
      try {
        streams = await Promise.all(
          Array.from({ length: 8 }, (_, i) =>
            openai[i % 2]!.chat.completions.create({ ...chat(content, maxTokens), stream: true, stream_options: { include_usage: true } })
              .withResponse()
              .then(
                ({ data, response }) => ({ ok: true as const, data, headers: response.headers }),
                (error: unknown) => ({ ok: false as const, error }),
              ),
          ),
        );
      } finally {
        worker.process.signal('SIGCONT');
      }
      const admitted = streams.filter((s) => s.ok);
      const refused = streams.filter((s) => !s.ok);
      expect(admitted).toHaveLength(3);
      for (const r of refused) {
        expect(r.error).toBeInstanceOf(OpenAI.RateLimitError);
        expect((r.error as InstanceType<typeof OpenAI.RateLimitError>).headers?.get('retry-after')).toMatch(/^\d+$/);
      }
      // Remaining tokens after each admission: budget - k × reservation, never below 0.
      const remaining = admitted.map((s) => Number(s.headers.get('x-ratelimit-remaining-tokens'))).sort((a, b) => b - a);
      expect(remaining).toEqual([1, 2, 3].map((k) => budget - k * reservation));
      for (const s of admitted) expect(s.headers.get('x-ratelimit-limit-tokens')).toBe(String(budget));

      let streamed = 0;
      for (const s of admitted) {
        let usage: { prompt_tokens: number; completion_tokens: number } | undefined;
        let chunks = 0;
        for await (const chunk of s.data) {
          if (chunk.choices[0]?.delta.content) chunks++;
          if (chunk.usage) usage = chunk.usage;
        }
        expect(usage).toBeDefined();
        expect(usage!.completion_tokens).toBeGreaterThanOrEqual(chunks > 0 ? 1 : 0);
        streamed += usage!.prompt_tokens + usage!.completion_tokens;
      }
      // Settled: the key's window now holds exactly the tokens the three streams used.
      const redis = cluster.redis.client();
      try {
        const totalKey = `sluice:ratelimit:{${hashApiKey(key)}}:token-total`;
        await waitFor(
          'the three reservations settled',
          async () => (Number(await redis.get(totalKey)) === streamed ? true : undefined),
          5_000,
        );
      } finally {
        redis.disconnect();
      }
      const metrics = await Promise.all(gateways.map((g) => scrapePrometheus(`${g.url}/metrics`)));
      const used = metrics.reduce(
        (sum, m) =>
          sum +
          m.value('sluice_gateway_key_tokens_total', { key: 'tpm', kind: 'prompt' }) +
          m.value('sluice_gateway_key_tokens_total', { key: 'tpm', kind: 'completion' }),
        0,
      );
      expect(used).toBe(streamed);
      // What the settlement gave back is usable at once, to the token: a request reserving one token
      // more than is left is refused, one reserving exactly what is left is admitted.
      const fits = budget - streamed - probeUsage.prompt_tokens;
      const over = await post(gateways[0]!, key, chat(content, fits + 1));
      expect(over.status).toBe(429);
      expect(Number(over.headers.get('x-ratelimit-remaining-tokens'))).toBe(budget - streamed);
      await over.text();
      const exact = await post(gateways[1]!, key, chat(content, fits));
      expect(exact.status).toBe(200);
      expect(exact.headers.get('x-ratelimit-remaining-tokens')).toBe('0');
      await exact.text();
    });

    it('refuses a request larger than the whole --tpm budget with a 400 and no Retry-After (a retry could never pass), leaving the window untouched', async () => {
      const key = await keys('--name', 'tpm-small', '--tpm', '40');
      for (const gateway of gateways) {
        const over = await post(gateway, key, chat('hi', 64));
        expect(over.status).toBe(400);
        expect(over.headers.get('retry-after')).toBeNull();
        const body = (await over.json()) as { error: { code: string; type: string; param: string; message: string } };
        expect(body.error).toMatchObject({ code: 'tokens_over_key_limit', type: 'invalid_request_error', param: 'max_tokens' });
        expect(body.error.message).toMatch(/more than this key's 40 tokens per minute\. Lower max_tokens\./);
        // A prompt alone over the budget names the prompt.
        const prompt = await fetch(`${gateway.url}/v1/completions`, {
          method: 'POST',
          headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${key}` },
          body: JSON.stringify({ model: MODEL, prompt: 'word '.repeat(60), max_tokens: 1 }),
        });
        expect(prompt.status).toBe(400);
        expect(((await prompt.json()) as { error: { param: string } }).error.param).toBe('prompt');
        // The official client gets a BadRequestError at once (it retries 429s, not 400s).
        const error = await client(gateway, key)
          .chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_completion_tokens: 64 })
          .catch((e: unknown) => e);
        expect(error).toBeInstanceOf(OpenAI.BadRequestError);
        expect((error as InstanceType<typeof OpenAI.BadRequestError>).param).toBe('max_completion_tokens');
      }
      // Nothing was reserved: a request that fits is admitted against the whole budget.
      const fits = await post(gateways[0]!, key, chat('hi', 2));
      expect(fits.status).toBe(200);
      const usage = ((await fits.json()) as { usage: { prompt_tokens: number } }).usage;
      expect(Number(fits.headers.get('x-ratelimit-remaining-tokens'))).toBe(40 - usage.prompt_tokens - 2);
      const metrics = await Promise.all(gateways.map((g) => scrapePrometheus(`${g.url}/metrics`)));
      expect(
        metrics.reduce(
          (sum, m) => sum + m.value('sluice_gateway_key_refusals_total', { key: 'tpm-small', reason: 'tokens_over_limit' }),
          0,
        ),
      ).toBe(6);
      // (`tokens` is the 429 of a window too full for now: none here.)
      expect(
        metrics.reduce((sum, m) => sum + m.value('sluice_gateway_key_refusals_total', { key: 'tpm-small', reason: 'tokens' }), 0),
      ).toBe(0);
    });

    it('caps concurrent streams with --max-streams and frees a slot on every ending (a finished stream, a client that left)', async () => {
      const key = await keys('--name', 'streams2', '--max-streams', '2');
      const stream = (gateway: GatewayProcess) => post(gateway, key, { ...chat('go', 8), stream: true });
      worker.process.signal('SIGSTOP');
      try {
        // With the worker frozen, each 200 goes out after HEADERS_WAIT_MS and the streams stay open.
        const opened = await Promise.all([stream(gateways[0]!), stream(gateways[1]!)]);
        expect(opened.map((r) => r.status)).toEqual([200, 200]);
        const third = await stream(gateways[0]!);
        expect(third.status).toBe(429);
        expect((await third.json()) as object).toMatchObject({ error: { code: 'rate_limit_exceeded' } });
        // One client leaves: its slot is free, on the other gateway too.
        await opened[0].body?.cancel();
        const replacement = await waitFor('the slot of the client that left', async () => {
          const res = await stream(gateways[1]!);
          if (res.status === 200) return res;
          await res.text();
          return undefined;
        });
        worker.process.signal('SIGCONT');
        await Promise.all([opened[1].text(), replacement.text()]);
      } finally {
        worker.process.signal('SIGCONT');
      }
      // Both endings released their slots: two more at once are admitted. (A slot is released just after
      // its stream's last byte, one Redis call later: a starved machine may answer the client first.)
      await waitFor('two slots free again', async () => {
        const again = await Promise.all([post(gateways[0]!, key, chat('a', 2)), post(gateways[1]!, key, chat('b', 2))]);
        await Promise.all(again.map((r) => r.text()));
        return again.every((r) => r.status === 200) ? true : undefined;
      });
    });

    it('keeps a detached stream (resume grace) in flight under --max-streams until its grace or its resumed stream ends', async () => {
      const key = await keys('--name', 'graced', '--max-streams', '1');
      const streamsKey = `sluice:ratelimit:{${hashApiKey(key)}}:streams`;
      const body = { ...chat('a long one', 300), stream: true, ignore_eos: true, resume_grace_ms: 60_000 };
      worker.process.signal('SIGSTOP');
      let resumed: Response | undefined;
      let member: string | undefined;
      const redis = cluster.redis.client();
      try {
        const first = await post(gateways[0]!, key, body);
        expect(first.status).toBe(200);
        [member] = await redis.zrange(streamsKey, '0', '-1');
        expect(member).toBeDefined();
        // The client leaves within its grace: the generation goes on unseen, and keeps its slot for the
        // grace (it used to be freed, letting a key run any number of detached generations).
        await first.body?.cancel();
        await waitFor('the slot held for the grace', async () => {
          const score = await redis.zscore(streamsKey, member!);
          return score !== null && Number(score) < Date.now() + 120_000 ? true : undefined;
        });
        const second = await post(gateways[1]!, key, body);
        expect(second.status).toBe(429);
        await second.text();
        // Resumed on the other gateway: the slot is the resumed stream's while it runs...
        resumed = await fetch(`${gateways[1]!.url}/v1/chat/completions/chatcmpl-${member!}?stream=true`, {
          headers: { Authorization: `Bearer ${key}` },
        });
        expect(resumed.status).toBe(200);
        await waitFor('the slot held to the deadline again', async () => {
          const score = await redis.zscore(streamsKey, member!);
          return score !== null && Number(score) > Date.now() + 120_000 ? true : undefined;
        });
        worker.process.signal('SIGCONT');
        // ...and free once it ends.
        await resumed.text();
        await waitFor('the slot freed', async () => ((await redis.zscore(streamsKey, member!)) === null ? true : undefined));
        const third = await post(gateways[0]!, key, chat('after', 2));
        expect(third.status).toBe(200);
        await third.text();
      } finally {
        worker.process.signal('SIGCONT');
        redis.disconnect();
      }
    });
  });

  describe('per-key usage', () => {
    const keyTokens = async (name: string) => {
      const metrics = await Promise.all(gateways.map((g) => scrapePrometheus(`${g.url}/metrics`)));
      const sum = (kind: string) =>
        metrics.reduce((total, m) => total + m.value('sluice_gateway_key_tokens_total', { key: name, kind }), 0);
      return { prompt: sum('prompt'), completion: sum('completion') };
    };
    const usageOf = (text: string) => {
      const chunks = text
        .split('\n')
        .filter((line) => line.startsWith('data: {'))
        .map((line) => JSON.parse(line.slice(6)) as { usage?: { prompt_tokens: number; completion_tokens: number } | null });
      const usage = chunks.find((chunk) => chunk.usage)?.usage;
      expect(usage, `the stream ends with its usage:\n${text.slice(-600)}`).toBeDefined();
      return { prompt: usage!.prompt_tokens, completion: usage!.completion_tokens };
    };

    it('counts each token of a stream once under its key, whichever gateways deliver it (detached, resumed, replayed)', async () => {
      const key = await keys('--name', 'resumed-usage');
      const auth = { Authorization: `Bearer ${key}` };
      const body = {
        ...chat('count me once', 40),
        stream: true,
        stream_options: { include_usage: true },
        ignore_eos: true,
        resume_grace_ms: 60_000,
      };
      const resume = (gateway: GatewayProcess, id: string, cursor?: string) =>
        fetch(`${gateway.url}/v1/chat/completions/${id}?stream=true`, {
          headers: { ...auth, ...(cursor === undefined ? {} : { 'Last-Event-ID': cursor }) },
        });

      // 1. Nothing delivered before the client leaves (worker frozen): the whole answer arrives through
      //    a resume on the other gateway, and counts there.
      worker.process.signal('SIGSTOP');
      let id: string;
      try {
        const first = await post(gateways[0]!, key, body);
        expect(first.status).toBe(200);
        // The request id is the job's (the client sent none), and the chunks' id is built from it.
        id = `chatcmpl-${first.headers.get('x-request-id') ?? ''}`;
        await first.body?.cancel();
      } finally {
        worker.process.signal('SIGCONT');
      }
      const resumed = await resume(gateways[1]!, id);
      expect(resumed.status).toBe(200);
      const whole = usageOf(await resumed.text());
      expect(whole.completion).toBe(40);
      await waitFor('the resumed tokens counted under the key', async () => {
        const counted = await keyTokens('resumed-usage');
        return counted.prompt === whole.prompt && counted.completion === whole.completion ? true : undefined;
      });
      // 2. Replayed again, whole and from a cursor, on either gateway: nothing more is counted.
      await (await resume(gateways[0]!, id)).text();
      await (await resume(gateways[1]!, id, '3')).text();

      // 3. Part delivered, the rest resumed elsewhere from the cursor: the two deliveries add up to the answer.
      const second = await post(gateways[1]!, key, body);
      expect(second.status).toBe(200);
      let cursor: string | undefined;
      let secondId = '';
      const reader = second.body!.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = '';
      while (cursor === undefined) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        const event = /id: (\d+)\ndata: (\{.*"content":"[^"]+".*\})\n\n/.exec(buffer);
        if (event) {
          cursor = event[1];
          secondId = (JSON.parse(event[2]!) as { id: string }).id;
        }
      }
      expect(cursor).toBeDefined();
      await reader.cancel();
      const rest = await resume(gateways[0]!, secondId, cursor);
      expect(rest.status).toBe(200);
      const secondUsage = usageOf(await rest.text());
      await waitFor('both deliveries counted, once', async () => {
        const counted = await keyTokens('resumed-usage');
        return counted.prompt === whole.prompt + secondUsage.prompt && counted.completion === whole.completion + secondUsage.completion
          ? true
          : undefined;
      });
      // Nothing late makes it more.
      await sleep(300);
      expect(await keyTokens('resumed-usage')).toEqual({
        prompt: whole.prompt + secondUsage.prompt,
        completion: whole.completion + secondUsage.completion,
      });
    });
  });

  describe('browser safety', () => {
    it('answers a CORS preflight for an allowed origin, and not for another', async () => {
      const preflight = (origin: string) =>
        fetch(`${gateways[0]!.url}/v1/chat/completions`, {
          method: 'OPTIONS',
          headers: {
            Origin: origin,
            'Access-Control-Request-Method': 'POST',
            'Access-Control-Request-Headers': 'authorization,content-type',
          },
        });
      const allowed = await preflight(allowedOrigin);
      expect(allowed.status).toBe(204);
      expect(allowed.headers.get('access-control-allow-origin')).toBe(allowedOrigin);
      expect(allowed.headers.get('access-control-allow-headers')).toMatch(/authorization/);
      const other = await preflight(otherOrigin);
      expect(other.headers.get('access-control-allow-origin')).toBeNull();
    });

    it('refuses a POST body that is not application/json with 415, before looking at the key', async () => {
      for (const contentType of ['text/plain', 'application/x-www-form-urlencoded', 'multipart/form-data; boundary=x']) {
        const res = await fetch(`${gateways[1]!.url}/v1/chat/completions`, {
          method: 'POST',
          headers: { 'Content-Type': contentType },
          body: JSON.stringify(chat('hi', 2)),
        });
        expect(res.status).toBe(415);
        expect(await res.json()).toMatchObject({ error: { code: 'unsupported_media_type' } });
      }
    });

    it('puts the security headers on every reply: JSON, errors and streams', async () => {
      const key = await keys('--name', 'headers');
      const replies = [
        await fetch(`${gateways[0]!.url}/healthz`),
        await post(gateways[0]!, undefined, chat('hi', 2)),
        await post(gateways[0]!, key, { ...chat('hi', 2), stream: true }),
        await post(gateways[0]!, key, chat('hi', 2)),
      ];
      for (const res of replies) {
        expect(res.headers.get('x-content-type-options')).toBe('nosniff');
        expect(res.headers.get('x-frame-options')).toBe('DENY');
        expect(res.headers.get('cross-origin-resource-policy')).toBe('same-origin');
        expect(res.headers.get('referrer-policy')).toBe('no-referrer');
        await res.text();
      }
    });

    it.skipIf(!hasChromium())(
      'lets a page on an allowed origin stream a completion in real Chromium, and blocks a page on another origin',
      async () => {
        const key = await keys('--name', 'browser');
        let browser: Browser | undefined;
        try {
          browser = await launchChromium();
          const page = await browser.newPage();
          const call = (args: { url: string; key: string; model: string; contentType: string }) =>
            page.evaluate(async ({ url, key, model, contentType }) => {
              try {
                const res = await fetch(url, {
                  method: 'POST',
                  headers: { 'Content-Type': contentType, Authorization: `Bearer ${key}` },
                  body: JSON.stringify({ model, messages: [{ role: 'user', content: 'hello' }], max_tokens: 8, stream: true }),
                });
                const reader = res.body!.getReader();
                const decoder = new TextDecoder();
                let text = '';
                for (;;) {
                  const { done, value } = await reader.read();
                  if (done) break;
                  text += decoder.decode(value, { stream: true });
                }
                return { status: res.status, text, remaining: res.headers.get('x-request-id') };
              } catch (error) {
                return { error: String(error) };
              }
            }, args);
          const url = `${gateways[1]!.url}/v1/chat/completions`;

          await page.goto(`${allowedOrigin}/`);
          const streamed = await call({ url, key, model: MODEL, contentType: 'application/json' });
          expect(streamed).toMatchObject({ status: 200 });
          expect((streamed as { text: string }).text).toMatch(/^data: \{.*"chat\.completion\.chunk"/m);
          expect((streamed as { text: string }).text).toContain('data: [DONE]');
          // The exposed headers are readable cross-origin.
          expect((streamed as { remaining: string | null }).remaining).toMatch(/^[\w.-]+$/);
          // A text/plain POST (no preflight needed) is refused before any work.
          expect(await call({ url, key, model: MODEL, contentType: 'text/plain' })).toMatchObject({ status: 415 });

          await page.goto(`${otherOrigin}/`);
          const blocked = await call({ url, key, model: MODEL, contentType: 'application/json' });
          expect(blocked).toMatchObject({ error: expect.stringMatching(/TypeError|Failed to fetch/) });
        } finally {
          await browser?.close();
        }
      },
    );
  });

  describe('connections', () => {
    it('closes a connection whose headers do not arrive within HEADERS_TIMEOUT_MS (408), instead of Node’s minute', async () => {
      const gateway = await cluster.gateway(
        { AUTH: 'none', HEADERS_TIMEOUT_MS: '500', HTTP_REQUEST_TIMEOUT_MS: '1000' },
        { waitReady: false },
      );
      const { port } = new URL(gateway.url);
      const reply = await new Promise<string>((resolve, reject) => {
        const socket = connect({ host: '127.0.0.1', port: Number(port) });
        let data = '';
        socket.setEncoding('utf8').on('data', (text: string) => (data += text));
        socket.once('error', reject);
        socket.once('close', () => resolve(data));
        // Half a request head, then nothing.
        socket.write('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n');
      });
      expect(reply).toMatch(/^HTTP\/1\.1 408/);
    });
  });
});

describe('the safe default', () => {
  let cluster: Cluster;
  beforeAll(async () => {
    cluster = await Cluster.start();
  });
  afterAll(async () => {
    await cluster?.stop();
  });

  const gatewayProcess = async (env: Record<string, string>) => {
    const port = await freePort();
    return startProcess('gateway', process.execPath, [GATEWAY_MAIN], {
      REDIS_URL: cluster.redis.url,
      PORT: String(port),
      LOG_LEVEL: 'info',
      ...env,
    });
  };

  it('refuses to start on a non-loopback address with no key, naming AUTH', async () => {
    const proc = await gatewayProcess({ HOST: '0.0.0.0' });
    const { code } = await proc.exited;
    expect(code).toBe(1);
    expect(proc.output()).toMatch(/refusing to start: HOST=0\.0\.0\.0 is not a loopback address/);
    expect(proc.output()).toMatch(/AUTH=none/);
  });

  it('starts on a non-loopback address with AUTH=none set explicitly, and on loopback with no key, saying so', async () => {
    for (const env of [{ HOST: '0.0.0.0', AUTH: 'none' }, { HOST: '127.0.0.1' }]) {
      const proc = await gatewayProcess(env);
      try {
        await waitFor(
          'the gateway to say AUTH=none',
          () => (/AUTH=none/.test(proc.output()) && /gateway listening/.test(proc.output()) ? true : undefined),
          20_000,
        );
      } finally {
        await proc.stop();
      }
    }
  });

  it('starts on a non-loopback address with a key from API_KEY, which then authenticates', async () => {
    const apiKey = 'operator-key-0123456789abcdef0123456789';
    const port = await freePort();
    const proc = startProcess('gateway', process.execPath, [GATEWAY_MAIN], {
      REDIS_URL: cluster.redis.url,
      PORT: String(port),
      HOST: '0.0.0.0',
      API_KEY: apiKey,
      LOG_LEVEL: 'info',
    });
    try {
      await waitFor('gateway listening', () => (/gateway listening/.test(proc.output()) ? true : undefined), 20_000);
      expect((await fetch(`http://127.0.0.1:${port}/v1/models`)).status).toBe(401);
      expect((await fetch(`http://127.0.0.1:${port}/v1/models`, { headers: { Authorization: `Bearer ${apiKey}` } })).status).toBe(200);
      const list = await runKeys(cluster.redis.url, ['list']);
      expect(list.stdout).toMatch(/^default\t/m);
    } finally {
      await proc.stop();
    }
  });
});
