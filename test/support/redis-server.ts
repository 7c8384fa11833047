/** A private `redis-server` on a free loopback port (never the one that may run on 6379). */
import { spawnSync } from 'node:child_process';
import { Redis } from 'ioredis';
import { freePort, startProcess, waitFor, type ManagedProcess } from './processes.js';

export interface RedisServer {
  readonly url: string;
  readonly port: number;
  readonly process: ManagedProcess;
  /** A new client (the caller quits it). */
  client(): Redis;
  stop(): Promise<void>;
}

export function hasRedisServer(): boolean {
  return spawnSync('redis-server', ['--version']).status === 0;
}

/**
 * @param options.port a fixed port: a Redis restarted where the old one was (its clients reconnect)
 * @param options.appendOnlyDir persistence: an append-only file in this folder, every write synced
 *   (a Redis restarted on the same folder comes back with everything acknowledged before it died)
 */
export async function startRedis(options: { port?: number; appendOnlyDir?: string } = {}): Promise<RedisServer> {
  // A free port can be taken between `freePort` and the server's bind (test files start servers side by
  // side): the probe then reached another file's server, and this file's tests ran on a Redis another
  // file freezes, kills or stops. The server answering must be this one; else another port.
  for (let tries = 1; ; tries++) {
    const server = await startRedisOnce(options);
    if (server !== undefined) return server;
    if (options.port !== undefined || tries === 5) throw new Error(`redis-server could not take ${options.port ?? 'a free port'}`);
  }
}

async function startRedisOnce(options: { port?: number; appendOnlyDir?: string }): Promise<RedisServer | undefined> {
  const port = options.port ?? (await freePort());
  const persistence =
    options.appendOnlyDir === undefined
      ? ['--appendonly', 'no']
      : ['--appendonly', 'yes', '--appendfsync', 'always', '--dir', options.appendOnlyDir];
  const proc = startProcess(
    'redis',
    'redis-server',
    ['--port', String(port), '--bind', '127.0.0.1', '--save', '', ...persistence, '--maxmemory-policy', 'noeviction'],
    {},
  );
  const url = `redis://127.0.0.1:${port}`;
  const probe = new Redis(url, { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null });
  probe.on('error', () => undefined);
  try {
    await waitFor(
      'redis-server',
      async () => {
        if (probe.status !== 'ready') await probe.connect().catch(() => probe.disconnect());
        return (await probe.ping()) === 'PONG' ? true : undefined;
      },
      10_000,
    );
    if (!new RegExp(`^process_id:${proc.pid}\\r?$`, 'm').test(await probe.info('server'))) {
      await proc.stop(2_000);
      return undefined;
    }
  } finally {
    probe.disconnect();
  }
  return {
    url,
    port,
    process: proc,
    client: () => new Redis(url, { maxRetriesPerRequest: null }),
    stop: () => proc.stop(2_000),
  };
}
