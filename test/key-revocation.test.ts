import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { redisNames } from '@sluice/protocol';
import { hashApiKey } from '../apps/gateway/src/auth/api-key.js';
import { createKey, runKeys } from './support/api-keys.js';
import { Cluster, MODEL } from './support/cluster.js';
import { startFrozenMidAnswers } from './support/mid-answer.js';
import { sleep, waitFor } from './support/processes.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { checkChunkSequence, LiveStream, streamError } from './support/sse.js';
import { readTokenLog } from './support/token-log.js';

/**
 * Revoking an API key ends its requests in flight, with the real processes: one redis-server, one
 * worker (tiny model), gateways with AUTH=keys, keys made and revoked with the `keys` command. The
 * worker is frozen (SIGSTOP) with every stream mid-answer when the key is revoked, so nothing ends
 * on its own and the test does not race the machine's speed.
 */

const MAX_TOKENS = 1800;
const long = (prompt: string, stream = true) => ({
  model: MODEL,
  prompt,
  max_tokens: MAX_TOKENS,
  ignore_eos: true,
  temperature: 0,
  stream,
});
const auth = (key: string) => ({ Authorization: `Bearer ${key}` });
const names = redisNames();

/** `promise`, or a rejection naming `what` after `ms`. */
async function within<T>(what: string, promise: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms)));
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

/** Waits for the request's token log to end, and says how its choice ended and how many tokens it has. */
async function loggedEnd(redis: Redis, jobId: string): Promise<{ finishReason: string | undefined; tokens: number }> {
  const log = await waitFor(`the token log of ${jobId} to end`, async () => {
    const entries = await readTokenLog(redis, jobId);
    return entries.some((entry) => entry.type === 'finish' || entry.type === 'error') ? entries : undefined;
  });
  let tokens = 0;
  let finishReason: string | undefined;
  for (const entry of log) {
    if (entry.type === 'text-delta') tokens += entry.tokens;
    if (entry.type === 'text-end') finishReason = entry.finishReason;
  }
  return { finishReason, tokens };
}

describe('revoking an API key', () => {
  let cluster: Cluster;
  let worker: WorkerProcess;
  let redis: Redis;
  /** Two gateways that never poll the registry during the test: only the revoke's announcement reaches them. */
  const announced: GatewayProcess[] = [];
  /** A gateway that polls every 200 ms (the harness's REGISTRY_POLL_MS). */
  let polling: GatewayProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    redis = cluster.redis.client();
    // A long TTL: the worker stays frozen while the test acts. LOG_LEVEL=info: its `request finished`
    // lines say why each sequence was aborted.
    worker = await cluster.worker({ WORKER_TTL_MS: '60000', LOG_LEVEL: 'info' });
    // Registered before the gateways start: the first two read the registry only then.
    await waitFor('the worker registered', async () => ((await redis.zcard(names.workersIndexKey)) > 0 ? true : undefined));
    const [a, b, c] = await Promise.all([
      cluster.gateway({ AUTH: 'keys', REGISTRY_POLL_MS: '600000' }),
      cluster.gateway({ AUTH: 'keys', REGISTRY_POLL_MS: '600000' }),
      cluster.gateway({ AUTH: 'keys' }),
    ]);
    announced.push(a, b);
    polling = c;
  }, 180_000);

  afterAll(async () => {
    worker?.process.signal('SIGCONT');
    redis?.disconnect();
    await cluster?.stop();
  });

  it("ends the key's streams on both gateways and its waiting reply, stops their work, and leaves another key's stream alone", async () => {
    const [gw0, gw1] = announced as [GatewayProcess, GatewayProcess];
    const leaked = await createKey(cluster.redis.url, ['--name', 'leaked', '--max-streams', '20']);
    const other = await createKey(cluster.redis.url, ['--name', 'other']);
    const slotsKey = `sluice:ratelimit:{${hashApiKey(leaked)}}:streams`;
    const waitList = `${names.bullPrefix}:generate:wait`;

    const { streams } = await startFrozenMidAnswers([worker], redis, {
      start: () => [
        new LiveStream(`${gw0.url}/v1/completions`, long('A leaked key on the first gateway'), auth(leaked)),
        new LiveStream(`${gw1.url}/v1/completions`, long('A leaked key on the second gateway'), auth(leaked)),
        new LiveStream(`${gw0.url}/v1/completions`, long('Another key on the first gateway'), auth(other)),
      ],
      progress: (stream) => stream.until('a few chunks', () => stream.contentChunks >= 3),
      maxTokens: MAX_TOKENS,
    });
    const [first, second, bystander] = streams as [LiveStream, LiveStream, LiveStream];
    let bystanderEnded = false;
    void bystander.ended.then(() => (bystanderEnded = true));
    try {
      // A JSON (non-stream) request of the key, waiting in the queue for the frozen worker.
      const waiting = fetch(`${gw1.url}/v1/completions`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', ...auth(leaked) },
        body: JSON.stringify(long('A leaked key waiting for its whole answer', false)),
      });
      // (Awaited below; a test that fails before must not leave its rejection unhandled.)
      waiting.catch(() => undefined);
      await waitFor('the JSON request in the queue', async () => ((await redis.llen(waitList)) === 1 ? true : undefined));
      expect(await redis.zcard(slotsKey)).toBe(3);

      const revoked = await runKeys(cluster.redis.url, ['revoke', '--name', 'leaked']);
      expect(revoked.code, revoked.stderr).toBe(0);
      expect(revoked.stderr).toContain('its requests in flight are ended');

      // The worker is frozen: only the gateways can end them, and they must do so at once.
      for (const stream of [first, second]) {
        expect(await within('the stream to end', stream.ended, 5_000)).toBe('done');
        expect(stream.status).toBe(200);
        const data = stream.items.filter((item) => item.kind === 'data').map((item) => item.data);
        expect(data.at(-1)).toBe('[DONE]');
        expect(streamError(stream.items)).toEqual({
          message: expect.stringMatching(/revoked/) as unknown,
          type: 'invalid_request_error',
          param: null,
          code: 'invalid_api_key',
        });
        // Nothing but the answer so far before the error: no finish chunk.
        expect(data.filter((d) => d.includes('"finish_reason":"')).length).toBe(0);
      }
      const reply = await within('the JSON reply', waiting, 5_000);
      expect(reply.status).toBe(401);
      expect(await reply.json()).toMatchObject({
        error: { code: 'invalid_api_key', message: expect.stringMatching(/revoked/) as unknown },
      });
      // Its job left the queue, and the key's stream slots are all free: they settled as any ending does.
      await waitFor('the JSON request removed from the queue', async () => ((await redis.llen(waitList)) === 0 ? true : undefined));
      await waitFor('the stream slots freed', async () => ((await redis.zcard(slotsKey)) === 0 ? true : undefined));
      // The other key's stream on the same gateway goes on.
      await sleep(200);
      expect(bystanderEnded).toBe(false);
    } finally {
      worker.process.signal('SIGCONT');
    }

    expect(await bystander.ended).toBe('done');
    const answer = checkChunkSequence(bystander.items, 'completion', false);
    expect(answer.finishReason).toBe('length');

    // The worker stopped the key's sequences (a cancel, as for a client that left): their logs end
    // with the choice aborted, far short of what was asked, and the worker says why.
    for (const stream of [first, second]) {
      const end = await loggedEnd(redis, stream.jobId);
      expect(end.finishReason).toBe('abort');
      expect(end.tokens).toBeLessThan(MAX_TOKENS);
    }
    expect((await loggedEnd(redis, bystander.jobId)).tokens).toBe(MAX_TOKENS);
    await waitFor('the worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
    expect(worker.process.output().match(/"abortReason":"key_revoked"/g)?.length).toBe(2);

    // And the key is refused from now on, on every gateway.
    for (const gateway of [gw0, gw1, polling]) {
      const res = await fetch(`${gateway.url}/v1/completions`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', ...auth(leaked) },
        body: JSON.stringify({ model: MODEL, prompt: 'again', max_tokens: 2 }),
      });
      expect(res.status).toBe(401);
    }
  });

  it('cancels its detached requests, running or waiting: nobody may resume them any more', async () => {
    const [gw0, gw1] = announced as [GatewayProcess, GatewayProcess];
    const key = await createKey(cluster.redis.url, ['--name', 'left']);
    const waitList = `${names.bullPrefix}:generate:wait`;
    const graceful = (prompt: string) => ({ ...long(prompt), resume_grace_ms: 120_000 });
    const { streams } = await startFrozenMidAnswers([worker], redis, {
      start: () => [new LiveStream(`${gw0.url}/v1/completions`, graceful('A client that leaves mid-answer'), auth(key))],
      progress: (stream) => stream.until('a few chunks', () => stream.contentChunks >= 3),
      maxTokens: MAX_TOKENS,
    });
    const running = streams[0]!;
    let waitingId: string | undefined;
    try {
      // A second stream waits in the queue behind the frozen worker; both clients leave within their
      // grace: no gateway holds a session of either any more.
      const waiting = new LiveStream(`${gw1.url}/v1/completions`, graceful('A client that leaves while queued'), auth(key));
      await waitFor('the second stream in the queue', async () => ((await redis.llen(waitList)) === 1 ? true : undefined));
      waitingId = (await redis.lrange(waitList, 0, 0))[0]!;
      for (const stream of [running, waiting]) stream.abort();
      for (const id of [running.jobId, waitingId]) {
        await waitFor(`${id} detached`, async () => ((await redis.hget(names.metaKey(id), 'detachedAt')) ? true : undefined));
      }

      const revoked = await runKeys(cluster.redis.url, ['revoke', '--name', 'left']);
      expect(revoked.code, revoked.stderr).toBe(0);
      // The waiting one leaves the queue at once (the worker is still frozen); its log ends it.
      await waitFor('the waiting request removed from the queue', async () => ((await redis.llen(waitList)) === 0 ? true : undefined));
      expect((await loggedEnd(redis, waitingId)).finishReason).toBe('abort');
    } finally {
      worker.process.signal('SIGCONT');
    }
    // The running one is stopped by its worker once thawed (it used to run on to max_tokens unseen).
    const end = await loggedEnd(redis, running.jobId);
    expect(end.finishReason).toBe('abort');
    expect(end.tokens).toBeLessThan(MAX_TOKENS);
    await waitFor('the worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
    expect(worker.process.output()).toMatch(new RegExp(`"requestId":"${running.jobId}"[^\\n]*"abortReason":"key_revoked"`));
  });

  it('ends them at the next registry poll on a gateway that missed the announcement', async () => {
    const key = await createKey(cluster.redis.url, ['--name', 'missed']);
    const { streams } = await startFrozenMidAnswers([worker], redis, {
      start: () => [new LiveStream(`${polling.url}/v1/completions`, long('A key whose revoke went unheard'), auth(key))],
      progress: (stream) => stream.until('a few chunks', () => stream.contentChunks >= 3),
      maxTokens: MAX_TOKENS,
    });
    const stream = streams[0]!;
    try {
      // Deleted behind the gateways' backs, announced to none: as for a gateway whose subscriber was
      // reconnecting when the revoke went out.
      await redis.multi().hdel('sluice:apikey-names', 'missed').hdel('sluice:apikeys', hashApiKey(key)).exec();
      expect(await within('the stream to end', stream.ended, 5_000)).toBe('done');
      expect(streamError(stream.items)).toMatchObject({ code: 'invalid_api_key' });
    } finally {
      worker.process.signal('SIGCONT');
    }
    expect((await loggedEnd(redis, stream.jobId)).finishReason).toBe('abort');
  });
});
