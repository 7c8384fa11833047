import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startRedis, type RedisServer } from './support/redis-server.js';
import { waitFor } from './support/processes.js';
import { decodeRequestMeta, encodeRequestMeta, redisNames, RequestScripts } from '@sluice/protocol';

let server: RedisServer;
let redis: Redis;

beforeAll(async () => {
  server = await startRedis();
  redis = new Redis(server.url);
});

afterAll(async () => {
  await redis.quit();
  await server.stop();
});

describe('request scripts on a real Redis', () => {
  it("creates a request's meta with every field and its TTL in one command", async () => {
    const names = redisNames('t');
    const scripts = new RequestScripts(redis, names);
    const format = {
      endpoint: 'completion' as const,
      model: 'm',
      created: 7,
      includeUsage: false,
      n: 1,
      maxTokensParam: 'max_tokens' as const,
    };
    const meta = { channel: 'gw-1', graceMs: 500, attempt: 1, enqueuedAt: 11, deadlineAt: 22, format, owner: 'k1' };

    await expect(scripts.createMeta('r1', encodeRequestMeta(meta), 60_000)).resolves.toBe(1);

    expect(decodeRequestMeta(await redis.hgetall(names.metaKey('r1')))).toEqual(meta);
    const ttl = await redis.pttl(names.metaKey('r1'));
    expect(ttl).toBeGreaterThan(50_000);
    expect(ttl).toBeLessThanOrEqual(60_000);
  });

  describe("a step's entries written as one command", () => {
    const names = redisNames('w');
    let scripts: RequestScripts;
    let subscriber: Redis;
    const heard: Array<[string, string]> = [];
    beforeAll(async () => {
      scripts = new RequestScripts(redis, names);
      subscriber = new Redis(server.url);
      subscriber.on('message', (channel: string, message: string) => heard.push([channel, message]));
      await subscriber.subscribe('gw-a', 'gw-b');
    });
    afterAll(() => subscriber.quit());
    const log = async (id: string) => (await redis.xrange(names.logKey(id), '-', '+')).map(([entryId, fields]) => [entryId, fields[1]]);
    const append = (requestId: string, attempt: number, pairs: string[], workerId = '') => ({
      requestId,
      attempt,
      maxEntries: 100,
      ttlMs: 60_000,
      workerId,
      pairs,
    });

    it("appends each request's entries, fenced by its attempt, then publishes, and answers each", async () => {
      await redis.hset(names.metaKey('one'), 'attempt', '1');
      await redis.hset(names.metaKey('moved'), 'attempt', '2');
      const written = await scripts.writeEntries(
        [append('one', 1, ['0', 'a0', '1', 'a1'], 'w-1'), append('moved', 1, ['5', 'stale']), append('nometa', 1, ['0', 'c0'])],
        [
          { channel: 'gw-a', message: 'step-1' },
          { channel: 'gw-b', message: 'step-1b' },
          { channel: 'gw-none', message: 'lost' },
        ],
      );
      expect(written).toEqual({ appended: [1, 0, 1], receivers: [1, 1, 0] });
      expect(await log('one')).toEqual([
        ['0-1', 'a0'],
        ['1-1', 'a1'],
      ]);
      // Fenced out: a newer attempt owns it; nothing written, its meta untouched.
      expect(await log('moved')).toEqual([]);
      expect(await redis.hget(names.metaKey('moved'), 'workerId')).toBeNull();
      // No meta (a gateway's cancel of a removed job): the log is written, no meta is made.
      expect(await log('nometa')).toEqual([['0-1', 'c0']]);
      expect(await redis.exists(names.metaKey('nometa'))).toBe(0);
      expect(await redis.hget(names.metaKey('one'), 'workerId')).toBe('w-1');
      for (const key of [names.logKey('one'), names.metaKey('one'), names.logKey('nometa')]) {
        const ttl = await redis.pttl(key);
        expect(ttl).toBeGreaterThan(50_000);
        expect(ttl).toBeLessThanOrEqual(60_000);
      }
      await waitFor('two messages', () => (heard.length === 2 ? true : undefined));
      expect(heard).toEqual([
        ['gw-a', 'step-1'],
        ['gw-b', 'step-1b'],
      ]);
    });

    it("answers a refused append with its error and still makes the step's other writes", async () => {
      heard.length = 0;
      await redis.hset(names.metaKey('again'), 'attempt', '1');
      await scripts.writeEntries([append('again', 1, ['0', 'x0'])]);
      // The same entries again (a command resent after a reconnect): XADD refuses an id not above the top.
      const written = await scripts.writeEntries(
        [append('again', 1, ['0', 'x0']), append('fresh', 1, ['0', 'f0'])],
        [{ channel: 'gw-a', message: 'step-2' }],
      );
      expect(written.appended[0]).toBeInstanceOf(Error);
      expect((written.appended[0] as Error).message).toContain('equal or smaller than the target stream top item');
      expect(written.appended[1]).toBe(1);
      expect(written.receivers).toEqual([1]);
      expect(await log('fresh')).toEqual([['0-1', 'f0']]);
      // Out of memory: every append refused, each answered with Redis's error; the publish still goes.
      await redis.config('SET', 'maxmemory', '1');
      try {
        const full = await scripts.writeEntries(
          [append('again', 1, ['1', 'x1']), append('fresh', 1, ['1', 'f1'])],
          [{ channel: 'gw-b', message: 'step-3' }],
        );
        expect(full.appended.map((reply) => (reply instanceof Error ? reply.message.slice(0, 3) : reply))).toEqual(['OOM', 'OOM']);
        expect(full.receivers).toEqual([1]);
      } finally {
        await redis.config('SET', 'maxmemory', '0');
      }
      expect(await log('again')).toEqual([['0-1', 'x0']]);
      await waitFor('two messages', () => (heard.length === 2 ? true : undefined));
      expect(heard.map(([, message]) => message)).toEqual(['step-2', 'step-3']);
    });

    it('writes nothing and answers nothing for an empty step', async () => {
      await expect(scripts.writeEntries([])).resolves.toEqual({ appended: [], receivers: [] });
    });
  });

  describe("a lost worker's request moved to a new attempt", () => {
    const names = redisNames('m');
    let scripts: RequestScripts;
    beforeAll(() => {
      scripts = new RequestScripts(redis, names);
    });
    const format = { endpoint: 'chat' as const, model: 'm', created: 7, includeUsage: false, n: 1, maxTokensParam: 'max_tokens' as const };
    const create = async (id: string, channel: string, detachedAt?: number) => {
      const meta = { channel, graceMs: 500, attempt: 1, enqueuedAt: 11, deadlineAt: Date.now() + 60_000, format };
      await scripts.createMeta(id, encodeRequestMeta(meta), 60_000);
      await redis.hset(names.metaKey(id), 'workerId', 'w-lost', 'detachedAt', detachedAt ?? '');
    };
    const meta = async (id: string) => decodeRequestMeta(await redis.hgetall(names.metaKey(id)));

    it('routes live entries to the gateway that moves it when the route is its own, or detached', async () => {
      await create('own', 'gw-a');
      await expect(scripts.migrate('own', 1, 'w-lost', 3, 'gw-a', 'gateway')).resolves.toEqual([1, 2]);
      expect(await meta('own')).toMatchObject({ attempt: 2, channel: 'gw-a' });
      await create('det', '', 5);
      await expect(scripts.migrate('det', 1, 'w-lost', 3, '', 'gateway')).resolves.toEqual([1, 2]);
      expect(await meta('det')).toMatchObject({ attempt: 2, channel: '', detachedAt: 5 });
    });

    it("keeps the route of a request resumed on another gateway since the mover read it (a stale session's move, a detached request's move)", async () => {
      await create('stale', 'gw-b');
      await expect(scripts.migrate('stale', 1, 'w-lost', 3, 'gw-a', 'gateway')).resolves.toEqual([1, 2]);
      expect(await meta('stale')).toMatchObject({ attempt: 2, channel: 'gw-b' });
      await create('resumed', 'gw-b');
      await expect(scripts.migrate('resumed', 1, 'w-lost', 3, '', 'gateway')).resolves.toEqual([1, 2]);
      expect(await meta('resumed')).toMatchObject({ attempt: 2, channel: 'gw-b' });
      expect((await meta('resumed'))?.detachedAt).toBeUndefined();
    });

    it('publishes its announcement in the same step when it moves the request, and only then', async () => {
      const subscriber = new Redis(server.url);
      const heard: string[] = [];
      subscriber.on('message', (_channel: string, message: string) => heard.push(message));
      await subscriber.subscribe('m:gateways');
      const announce = { channel: 'm:gateways', message: 'moved-to-2' };
      await create('told', 'gw-a');
      await expect(scripts.migrate('told', 1, 'w-lost', 3, '', 'gateway', Date.now(), announce)).resolves.toEqual([1, 2]);
      // Moved already (attempt 2 now): no second announcement.
      await expect(scripts.migrate('told', 1, 'w-lost', 3, '', 'gateway', Date.now(), announce)).resolves.toEqual([0, 2]);
      // Published after the move, by anyone: heard after the announcement.
      await redis.publish('m:gateways', 'later');
      await waitFor('two messages', () => (heard.length === 2 ? true : undefined));
      expect(heard).toEqual(['moved-to-2', 'later']);
      await subscriber.quit();
    });

    it("takes a worker's detach (only it may know the gateway is gone) but never its stale route", async () => {
      // The worker found its gateway gone: the meta is detached from now on.
      await create('gone', 'gw-dead');
      await expect(scripts.migrate('gone', 1, 'w-lost', 3, '', 'worker', 42)).resolves.toEqual([1, 2]);
      expect(await meta('gone')).toMatchObject({ attempt: 2, channel: '', detachedAt: 42 });
      // Its view missed a detach (the client left with a grace): the request stays detached.
      await create('left', '', 5);
      await expect(scripts.migrate('left', 1, 'w-lost', 3, 'gw-a', 'worker')).resolves.toEqual([1, 2]);
      expect(await meta('left')).toMatchObject({ attempt: 2, channel: '', detachedAt: 5 });
      // Or a resume elsewhere: the route stays there.
      await create('moved', 'gw-b');
      await expect(scripts.migrate('moved', 1, 'w-lost', 3, 'gw-a', 'worker')).resolves.toEqual([1, 2]);
      expect(await meta('moved')).toMatchObject({ attempt: 2, channel: 'gw-b' });
    });
  });
});
