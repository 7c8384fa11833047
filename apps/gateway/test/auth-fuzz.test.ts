import fc from 'fast-check';
import type { Redis } from 'ioredis';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startRedis, type RedisServer } from '../../../test/support/redis-server.js';
import { startAccessControl } from '../src/auth/access-control.js';
import { credentialFrom, generateApiKey } from '../src/auth/api-key.js';
import { ApiKeyStore } from '../src/auth/api-key-store.js';
import { loadGatewayConfig } from '../src/config.js';
import { closeAppHarnesses, startAppHarness, type AppHarness } from './support/app-harness.js';

/**
 * fast-check against the real app with AUTH=keys and a real redis-server: whatever arrives in
 * `Authorization` / `x-api-key`, the reply is never a 5xx, and only an issued, unrevoked key passes.
 */

/** Header-safe strings: visible ASCII, spaces, tabs and Latin-1 (what an HTTP/1.1 header can carry). */
const headerText = fc.string({
  unit: fc.oneof(
    fc.integer({ min: 0x20, max: 0x7e }).map((c) => String.fromCharCode(c)),
    fc.constantFrom('\t', ' ', 'Bearer ', 'bearer ', 'sk-sluice-', '\u00e9', '\u00ff'),
  ),
  maxLength: 120,
});

describe('the auth header and the key store under fuzzing', () => {
  let redisServer: RedisServer;
  let redis: Redis;
  let store: ApiKeyStore;
  let app: AppHarness;
  const issued: string[] = [];
  let revoked: string;

  beforeAll(async () => {
    redisServer = await startRedis();
    redis = redisServer.client();
    store = new ApiKeyStore(redis, 'fuzz');
    for (const name of ['a', 'b', 'c']) issued.push(await store.create(name));
    revoked = await store.create('revoked');
    await store.revoke('revoked');
    const config = loadGatewayConfig({ AUTH: 'keys', REDIS_PREFIX: 'fuzz', HOST: '127.0.0.1' });
    const access = await startAccessControl(config, redis, pino({ level: 'silent' }), {
      admitted() {},
      used() {},
      refused() {},
      authFailed() {},
    });
    app = await startAppHarness({ AUTH: 'keys' }, { access });
  });

  afterAll(async () => {
    await closeAppHarnesses();
    redis?.disconnect();
    await redisServer?.stop();
  });

  /** A header value that presents an issued key, or not: the app must agree with this. */
  const presentsIssuedKey = (authorization: string | undefined, xApiKey: string | undefined) => {
    const key = credentialFrom(authorization, xApiKey);
    return key !== undefined && issued.includes(key);
  };

  const mutatedKey = fc
    .tuple(fc.constantFrom(...[0, 1, 2]), fc.nat(), fc.constantFrom('flip', 'drop', 'append', 'upper', 'revoked', 'fresh'))
    .map(([i, at, how]) => {
      const key = issued[i]!;
      const p = at % key.length;
      switch (how) {
        case 'flip':
          return key.slice(0, p) + (key[p] === 'A' ? 'B' : 'A') + key.slice(p + 1);
        case 'drop':
          return key.slice(0, p) + key.slice(p + 1);
        case 'append':
          return `${key}x`;
        case 'upper':
          return key.toUpperCase();
        case 'revoked':
          return revoked;
        default:
          return generateApiKey();
      }
    });

  it('never answers 5xx and never accepts a key that was not issued (Authorization and x-api-key)', async () => {
    const value = fc.oneof(
      headerText,
      mutatedKey.map((k) => `Bearer ${k}`),
      fc.constantFrom(...issued).map((k) => `Bearer ${k}`),
      mutatedKey,
    );
    await fc.assert(
      fc.asyncProperty(
        fc.option(value, { nil: undefined }),
        fc.option(fc.oneof(headerText, mutatedKey), { nil: undefined }),
        fc.boolean(),
        async (authorization, xApiKey, chat) => {
          const headers: Record<string, string> = { 'Content-Type': 'application/json' };
          if (authorization !== undefined) headers.Authorization = authorization;
          if (xApiKey !== undefined) headers['x-api-key'] = xApiKey;
          const res = chat
            ? await fetch(`${app.url}/v1/chat/completions`, {
                method: 'POST',
                headers,
                body: JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'hi' }], max_tokens: 'x' }),
              })
            : await fetch(`${app.url}/v1/models`, { headers });
          await res.text();
          expect(res.status).toBeLessThan(500);
          if (presentsIssuedKey(authorization?.trim(), xApiKey)) expect(res.status).not.toBe(401);
          else expect(res.status).toBe(401);
        },
      ),
      { numRuns: 300 },
    );
  });

  it('finds exactly the issued, unrevoked keys through any sequence of creates, revokes and lookups', async () => {
    const op = fc.oneof(
      fc.record({ kind: fc.constant('create' as const), name: fc.oneof(fc.constantFrom('k1', 'k2', 'k3'), fc.string({ maxLength: 70 })) }),
      fc.record({ kind: fc.constant('revoke' as const), name: fc.oneof(fc.constantFrom('k1', 'k2', 'k3'), fc.string({ maxLength: 10 })) }),
      fc.record({ kind: fc.constant('find' as const), key: fc.oneof(headerText, fc.constant('')) }),
    );
    let run = 0;
    await fc.assert(
      fc.asyncProperty(fc.array(op, { maxLength: 25 }), async (ops) => {
        const prefix = `model-${run++}`;
        const live = new Map<string, string>(); // name → key
        const gone: string[] = [];
        const s = new ApiKeyStore(redis, prefix);
        for (const o of ops) {
          if (o.kind === 'create') {
            const valid = /^[\w.-]{1,64}$/.test(o.name);
            const created = await s.create(o.name).catch(() => undefined);
            expect(created !== undefined).toBe(valid && !live.has(o.name));
            if (created !== undefined) live.set(o.name, created);
          } else if (o.kind === 'revoke') {
            const key = live.get(o.name);
            expect(await s.revoke(o.name)).toBe(key !== undefined);
            if (key !== undefined) {
              live.delete(o.name);
              gone.push(key);
            }
          } else {
            expect(await s.find(o.key)).toBeUndefined();
          }
        }
        for (const [name, key] of live) expect((await s.find(key))?.name).toBe(name);
        for (const key of gone) expect(await s.find(key)).toBeUndefined();
        expect((await s.list()).map((k) => k.name)).toEqual([...live.keys()].sort((a, b) => a.localeCompare(b)));
      }),
      { numRuns: 100 },
    );
  });
});
