#!/usr/bin/env node
/**
 * `npm run keys -- <command>`: manage the API keys every gateway shares (in Redis at REDIS_URL, under
 * REDIS_PREFIX).
 *
 *   create --name <name> [--rpm N] [--tpm N] [--max-streams N] [--models a,b]
 *       Prints the new key, alone, on stdout (the only time it is shown): `KEY=$(npm run -s keys -- create --name ci)`.
 *   list [--json]      Names, limits, models, creation time; never the keys.
 *   revoke --name <name>
 *       Deletes the key and tells every gateway: its requests in flight end (a 401 / an SSE error frame).
 */
import { parseArgs } from 'node:util';
import { Redis } from 'ioredis';
import { z } from 'zod';
import { DEFAULT_PREFIX, redactRedisUrl } from '@sluice/protocol';
import { ApiKeyStore, ApiKeyStoreError } from '../auth/api-key-store.js';
import type { ApiKeyLimits } from '../auth/api-key.js';

const USAGE = `usage: npm run keys -- create --name <name> [--rpm N] [--tpm N] [--max-streams N] [--models a,b]
       npm run keys -- list [--json]
       npm run keys -- revoke --name <name>
Redis: REDIS_URL (default redis://127.0.0.1:6379), REDIS_PREFIX (default ${DEFAULT_PREFIX}).`;

class UsageError extends Error {}

function positive(flag: string, value: string | undefined): number | undefined {
  if (value === undefined) return undefined;
  // Plain decimal digits only (Number() alone also took "1e3", "0x10" and padded values).
  const n = /^\d+$/.test(value) ? Number(value) : NaN;
  if (!Number.isSafeInteger(n) || n < 1) throw new UsageError(`--${flag} must be a positive integer (got "${value}")`);
  return n;
}

async function main(argv: string[]): Promise<number> {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      name: { type: 'string' },
      rpm: { type: 'string' },
      tpm: { type: 'string' },
      'max-streams': { type: 'string' },
      models: { type: 'string' },
      json: { type: 'boolean' },
      help: { type: 'boolean', short: 'h' },
    },
  });
  const command = positionals[0];
  if (values.help === true || command === undefined) {
    process.stderr.write(`${USAGE}\n`);
    return values.help === true ? 0 : 2;
  }
  if (positionals.length > 1) throw new UsageError(`unexpected argument "${positionals[1]}" (options take --name <name> form)`);
  const parsed = z
    .object({
      REDIS_URL: z.url({ protocol: /^rediss?$/, error: 'must be a redis:// or rediss:// URL' }).default('redis://127.0.0.1:6379'),
      REDIS_PREFIX: z.string().min(1).default(DEFAULT_PREFIX),
    })
    .safeParse(Object.fromEntries(Object.entries(process.env).filter(([, v]) => v !== undefined && v.trim() !== '')));
  if (!parsed.success) {
    const problems = parsed.error.issues.map((issue) => `${issue.path.join('.')} ${issue.message}`);
    process.stderr.write(`keys: invalid environment: ${problems.join('; ')}\n`);
    return 1;
  }
  const env = parsed.data;
  const redis = new Redis(env.REDIS_URL, { lazyConnect: true, maxRetriesPerRequest: 1, retryStrategy: () => null });
  // The cause (ECONNREFUSED, WRONGPASS…) comes as an event; connect() rejects with "Connection is closed".
  let cause: Error | undefined;
  redis.on('error', (error: Error) => (cause ??= error));
  try {
    await redis.connect();
    // A Redis that requires a password answers the first command, not the connection, with NOAUTH.
    await redis.ping();
  } catch (error) {
    const message = (cause ?? (error as Error)).message;
    const refused = /^(NOAUTH|WRONGPASS)\b/.test(message);
    process.stderr.write(
      refused
        ? `keys: Redis at ${redactRedisUrl(env.REDIS_URL)} refused to authenticate (check the user and password in REDIS_URL): ${message}\n`
        : `keys: cannot reach Redis at ${redactRedisUrl(env.REDIS_URL)}: ${message}\n`,
    );
    redis.disconnect();
    return 1;
  }
  const store = new ApiKeyStore(redis, env.REDIS_PREFIX);
  try {
    switch (command) {
      case 'create': {
        if (values.name === undefined) throw new UsageError('create needs --name <name>');
        const limits: ApiKeyLimits = {};
        const rpm = positive('rpm', values.rpm);
        const tpm = positive('tpm', values.tpm);
        const maxStreams = positive('max-streams', values['max-streams']);
        if (rpm !== undefined) limits.rpm = rpm;
        if (tpm !== undefined) limits.tpm = tpm;
        if (maxStreams !== undefined) limits.maxStreams = maxStreams;
        const models = values.models
          ?.split(',')
          .map((m) => m.trim())
          .filter((m) => m !== '');
        // A key for no model at all is a typo, not a policy (revoke the key to refuse it everything).
        if (models !== undefined && models.length === 0) throw new UsageError('--models needs at least one model id (a,b)');
        const key = await store.create(values.name, limits, models);
        process.stdout.write(`${key}\n`);
        process.stderr.write(`keys: created "${values.name}"; the key above is not stored anywhere readable, keep it now.\n`);
        return 0;
      }
      case 'list': {
        const keys = await store.list();
        if (values.json === true) {
          process.stdout.write(`${JSON.stringify(keys)}\n`);
          return 0;
        }
        for (const k of keys) {
          const limits = [`rpm=${k.limits.rpm ?? '-'}`, `tpm=${k.limits.tpm ?? '-'}`, `max-streams=${k.limits.maxStreams ?? '-'}`].join(
            ' ',
          );
          process.stdout.write(
            `${k.name}\t${limits}\tmodels=${k.models?.join(',') ?? '*'}\tcreated=${new Date(k.createdAt).toISOString()}\tsha256=${k.hashPrefix}…\n`,
          );
        }
        if (keys.length === 0) process.stderr.write('keys: no API key exists\n');
        return 0;
      }
      case 'revoke': {
        if (values.name === undefined) throw new UsageError('revoke needs --name <name>');
        if (!(await store.revoke(values.name))) {
          process.stderr.write(`keys: no key named "${values.name}"\n`);
          return 1;
        }
        process.stderr.write(
          `keys: revoked "${values.name}": refused by every gateway from now on, and its requests in flight are ended\n`,
        );
        return 0;
      }
      default:
        throw new UsageError(`unknown command "${command}"`);
    }
  } finally {
    redis.disconnect();
  }
}

try {
  process.exitCode = await main(process.argv.slice(2));
} catch (error) {
  if (error instanceof UsageError || error instanceof ApiKeyStoreError || (error as { code?: string }).code?.startsWith('ERR_PARSE_ARGS')) {
    process.stderr.write(`keys: ${(error as Error).message}\n${USAGE}\n`);
    process.exitCode = 2;
  } else throw error;
}
