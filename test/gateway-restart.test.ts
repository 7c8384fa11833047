import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { redisNames } from '@sluice/protocol';
import { Cluster, MODEL } from './support/cluster.js';
import { frozenLongChat, thaw } from './support/mid-answer.js';
import { waitFor } from './support/processes.js';
import type { WorkerProcess } from './support/sluice.js';
import { loggedAnswer, readTokenLog } from './support/token-log.js';

/**
 * docker-compose gives each gateway a fixed GATEWAY_ID and `restart: unless-stopped`. A gateway killed
 * mid-stream and restarted under the same id used to subscribe to the same channel: its predecessor's
 * streams (no resume grace: their clients are gone) kept a receiver for the worker's publishes and a
 * fresh alive key, so they were never ended as a dead gateway's and decoded unseen to max_tokens. Each
 * process now has a channel of its own. Real redis-server, gateway and worker processes; the worker
 * frozen (SIGSTOP) mid-answer while the gateway is killed (SIGKILL) and restarted.
 */
const MAX_TOKENS = 1500;
const names = redisNames('sluice');

describe('a gateway restarted under the same GATEWAY_ID', () => {
  let cluster: Cluster;
  let redis: Redis;
  let worker: WorkerProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the frozen worker must not look lost.
    worker = await cluster.worker({ WORKER_TTL_MS: '60000' });
    redis = cluster.redis.client();
  });

  afterAll(async () => {
    thaw([worker]);
    redis?.disconnect();
    await cluster?.stop();
  });

  it("stops its predecessor's streams whose clients are gone, and serves new ones", async () => {
    const first = await cluster.gateway({ GATEWAY_ID: 'gateway-1' });
    const stream = await frozenLongChat([worker], redis, first.url, MAX_TOKENS);
    const jobId = stream.jobId;
    const channel = (await redis.hget(names.metaKey(jobId), 'channel'))!;
    first.process.signal('SIGKILL');
    await first.process.exited;
    const second = await cluster.gateway({ GATEWAY_ID: 'gateway-1' });
    // Thawed once the dead process's alive key has lapsed: its worker then finds nobody on that channel.
    await waitFor('the dead gateway’s alive key gone', async () =>
      (await redis.exists(names.gatewayAliveKey(channel))) === 0 ? true : undefined,
    );
    thaw([worker]);
    const ends = await waitFor(
      "the dead gateway's stream ended",
      async () => {
        const ended = (await readTokenLog(redis, jobId)).filter((e) => e.type === 'text-end');
        return ended.length > 0 ? ended.map((e) => (e as { finishReason: string }).finishReason) : undefined;
      },
      60_000,
    );
    expect(ends).toEqual(['abort']);
    expect((await loggedAnswer(redis, jobId)).tokens).toBeLessThan(MAX_TOKENS);
    const next = await fetch(`${second.url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, prompt: 'Hello', max_tokens: 4, ignore_eos: true }),
    });
    expect(next.status).toBe(200);
    expect(await next.json()).toMatchObject({ choices: [{ finish_reason: 'length' }] });
  });
});
