/**
 * `node --import tsx bench/gateway/auth-overhead.ts`: what access control costs per request, on this
 * machine, against a real redis-server and real gateway processes.
 *
 * 1. `GET /v1/models` on a gateway with AUTH=none vs one with AUTH=keys (key looked up in Redis on every
 *    request), alternating rounds, sequential requests: median latency and the ratio.
 * 2. The limiter's admission script (RPM + TPM + streams in one EVALSHA) and its settlement vs a bare
 *    Redis PING round trip: medians and ratios.
 *
 * Writes bench-results/auth.json. Env: BENCH_REQUESTS (per round, default 500), BENCH_ROUNDS (6).
 */
import { mkdir, writeFile } from 'node:fs/promises';
import { cpus, loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { RateLimiter } from '../../apps/gateway/src/auth/rate-limiter.js';
import { hashApiKey } from '../../apps/gateway/src/auth/api-key.js';
import { createKey } from '../../test/support/api-keys.js';
import { startRedis } from '../../test/support/redis-server.js';
import { startGateway } from '../../test/support/sluice.js';
import { median, round } from './stats.js';

const root = fileURLToPath(new URL('../..', import.meta.url));
const requests = Number(process.env.BENCH_REQUESTS ?? 500);
const rounds = Number(process.env.BENCH_ROUNDS ?? 6);
const log = (message: string) => process.stderr.write(`[bench:auth] ${message}\n`);

async function timeEach(n: number, run: (i: number) => Promise<unknown>): Promise<number[]> {
  const out: number[] = [];
  for (let i = 0; i < n; i++) {
    const start = performance.now();
    await run(i);
    out.push(performance.now() - start);
  }
  return out;
}

const redis = await startRedis();
const gateways = await Promise.all([
  startGateway(redis.url, { AUTH: 'none' }, { waitReady: false }),
  startGateway(redis.url, { AUTH: 'keys' }, { waitReady: false }),
]);
try {
  const key = await createKey(redis.url, ['--name', 'bench']);
  const get = (url: string, headers: Record<string, string>) => async () => {
    const res = await fetch(`${url}/v1/models`, { headers });
    await res.arrayBuffer();
    if (res.status !== 200) throw new Error(`status ${res.status}`);
  };
  const none = get(gateways[0].url, {});
  const keyed = get(gateways[1].url, { Authorization: `Bearer ${key}` });
  await timeEach(200, none);
  await timeEach(200, keyed);
  const http = { none: [] as number[], keys: [] as number[] };
  for (let r = 0; r < rounds; r++) {
    http.none.push(...(await timeEach(requests, none)));
    http.keys.push(...(await timeEach(requests, keyed)));
  }

  const client = redis.client();
  const limiter = new RateLimiter(client, 'bench');
  const hash = hashApiKey(key);
  const limits = { rpm: 1_000_000_000, tpm: 1_000_000_000, maxStreams: 1_000_000 };
  const lua = { ping: [] as number[], admit: [] as number[], settle: [] as number[] };
  for (let r = 0; r < rounds; r++) {
    lua.ping.push(...(await timeEach(requests, () => client.ping())));
    lua.admit.push(...(await timeEach(requests, (i) => limiter.admit(hash, limits, `r${r}-${i}`, 100, 600_000, `o${r}-${i}`))));
    lua.settle.push(...(await timeEach(requests, (i) => limiter.settle(hash, `r${r}-${i}`, `o${r}-${i}`, 60))));
  }
  client.disconnect();

  const ms = (values: number[]) => round(median(values), 3);
  const result = {
    machine: { cpus: cpus().length, model: cpus()[0]?.model, loadavg: loadavg().map((v) => round(v, 2)) },
    samples: { http: http.none.length, lua: lua.ping.length },
    httpModelsMedianMs: { authNone: ms(http.none), authKeys: ms(http.keys), ratio: round(median(http.keys) / median(http.none), 2) },
    limiterMedianMs: {
      ping: ms(lua.ping),
      admit: ms(lua.admit),
      settle: ms(lua.settle),
      admitToPing: round(median(lua.admit) / median(lua.ping), 2),
      settleToPing: round(median(lua.settle) / median(lua.ping), 2),
    },
  };
  process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
  await mkdir(`${root}bench-results`, { recursive: true });
  await writeFile(`${root}bench-results/auth.json`, `${JSON.stringify(result, null, 2)}\n`);
  log('wrote bench-results/auth.json');
} finally {
  await Promise.all(gateways.map((g) => g.process.stop(3_000)));
  await redis.stop();
}
