import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { redisNames } from '@sluice/protocol';
import { Cluster } from './support/cluster.js';
import { frozenLongChat } from './support/mid-answer.js';
import { waitFor } from './support/processes.js';
import { empty, read } from './support/sse.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * A client on gateway A resumes its stream on gateway B while its old connection to A is still open;
 * then the worker dies and A, which still holds the old session, moves the request to a new attempt
 * first (B frozen with SIGSTOP so that A wins, whatever the machine's speed). The move used to route the
 * live entries back to A's channel, and when A's old connection closed (no grace) its cancel matched
 * the route and stopped the work the client was reading on B: the resumed stream ended `abort`. The
 * move now keeps a route that another gateway took since (MIGRATE_SCRIPT). Real redis-server, two
 * gateways, two workers, SIGSTOP/SIGKILL.
 */
const MAX_TOKENS = 1500;

describe("a stale gateway's move of a stream resumed elsewhere", () => {
  let cluster: Cluster;
  let redis: Redis;
  let lost: WorkerProcess;
  let a: GatewayProcess;
  let b: GatewayProcess;
  const names = redisNames('sluice');

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the frozen worker must not look lost before the test kills it.
    lost = await cluster.worker({ WORKER_TTL_MS: '60000' });
    [a, b] = await Promise.all([cluster.gateway({ GATEWAY_ID: 'gw-a' }), cluster.gateway({ GATEWAY_ID: 'gw-b' })]);
    redis = cluster.redis.client();
  });

  afterAll(async () => {
    b?.process.signal('SIGCONT');
    redis?.disconnect();
    await cluster?.stop();
  });

  it('keeps the route on the gateway the client reads, and the answer goes on to its end there', async () => {
    const lostId = (await lost.health()).workerId;
    const connection = await frozenLongChat([lost], redis, a.url, MAX_TOKENS);
    const jobId = connection.jobId;
    // The cursor of what the first connection has read.
    const cursor = connection.items.flatMap((item) => (item.kind === 'data' && item.id !== undefined ? [item.id] : [])).at(-1)!;
    await cluster.worker({ WORKER_TTL_MS: '3000' });
    const resumed = await fetch(`${b.url}/v1/chat/completions/chatcmpl-${jobId}?stream=true`, {
      headers: { 'Last-Event-ID': cursor },
    });
    expect(resumed.status).toBe(200);
    const channel = () => redis.hget(names.metaKey(jobId), 'channel');
    await waitFor('the route on B', async () => ((await channel())?.startsWith('sluice:gw:gw-b.') === true ? true : undefined));

    // The worker dies while B is frozen: A moves the request.
    b.process.signal('SIGSTOP');
    lost.process.signal('SIGKILL');
    await redis.del(names.workerKey(lostId));
    await waitFor('the request moved', async () => ((await redis.hget(names.metaKey(jobId), 'attempt')) === '2' ? true : undefined));
    expect(await channel()).toMatch(/^sluice:gw:gw-b\./);
    b.process.signal('SIGCONT');

    const rest = empty();
    rest.lastEventId = cursor;
    await read(resumed, rest, (c) => c.textChunks >= 2);
    // A's old connection closes (no grace): its cancel must not stop the work B's client reads.
    connection.abort();
    await read(resumed, rest);
    expect(rest.errors).toEqual([]);
    expect(['length', 'stop']).toContain(rest.finishReasons[0]);
  });
});
