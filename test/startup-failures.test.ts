import { execFileSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { cp, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createServer, type Server } from 'node:net';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { redactRedisUrl } from '@sluice/protocol';
import { createKey, runKeys } from './support/api-keys.js';
import { freePort, startProcess, waitFor, type ManagedProcess } from './support/processes.js';
import { hasRedisServer, startRedis, type RedisServer } from './support/redis-server.js';
import { GATEWAY_MAIN, startWorker, WORKER_MAIN } from './support/sluice.js';

/**
 * How the processes fail to start, and how `npm start` stops: real gateway, worker, keys CLI,
 * redis-server (one with a password) and `scripts/start.mjs` processes.
 */
const root = fileURLToPath(new URL('..', import.meta.url));
const PASSWORD = 'hunter2-not-for-logs';

/** Runs `main` to its exit and returns its code, its whole output (stdout and stderr) and its stderr alone. */
async function runToExit(
  name: string,
  main: string,
  env: Record<string, string>,
): Promise<{ code: number | null; output: string; stderr: string }> {
  const proc = startProcess(name, process.execPath, [main], env);
  let stderr = '';
  proc.child.stderr?.on('data', (text: string) => (stderr += text));
  const timer = setTimeout(() => proc.signal('SIGKILL'), 30_000);
  const { code } = await proc.exited;
  clearTimeout(timer);
  return { code, output: proc.output(), stderr };
}

/** The one line a process wrote on stderr (fails the test when it wrote more or none). */
function oneLine(stderr: string): string {
  expect(stderr, 'one line on stderr').toMatch(/^[^\n]+\n$/);
  return stderr.trimEnd();
}

describe('a Redis URL in a printed line', () => {
  it('hides the user and the password, and keeps host, port and database', () => {
    expect(redactRedisUrl('redis://:secret@host:6379/2')).toBe('redis://***@host:6379/2');
    expect(redactRedisUrl('rediss://user:p%40ss@10.0.0.1:6380')).toBe('rediss://***@10.0.0.1:6380');
    expect(redactRedisUrl('redis://:a/b@c@host:1')).toBe('redis://***@host:1');
    expect(redactRedisUrl('redis://127.0.0.1:6379')).toBe('redis://127.0.0.1:6379');
  });
});

describe('a setting refused at start', () => {
  it('stops the worker with a message naming a millisecond variable beyond the longest timer, and its maximum', async () => {
    const { code, output } = await runToExit('worker', WORKER_MAIN, { WORKER_HEARTBEAT_MS: '3000000000' });
    expect(code).toBe(1);
    expect(output).toMatch(/WORKER_HEARTBEAT_MS: must be at most 2147483647/);
    expect(output).not.toMatch(/TimeoutOverflowWarning/);
  });

  it('stops the worker before it loads a model when MAX_STEP_TOKENS is below MAX_BATCH_SIZE, naming both and the bound', async () => {
    // The model directory does not exist: a worker that looked at it first would say so instead.
    const { code, stderr } = await runToExit('worker', WORKER_MAIN, { MAX_STEP_TOKENS: '8', MODEL_DIR: `${root}no-such-model` });
    expect(code).toBe(1);
    expect(stderr).toContain('MAX_STEP_TOKENS: must be at least MAX_BATCH_SIZE (32), got 8');
    expect(stderr).not.toMatch(/no-such-model|model directory/);
  });

  it("names the settings and the model's context length when the engine cannot hold the KV cache they ask for", async () => {
    // KV_PREALLOCATE reserves MAX_BATCH_SIZE × 1.25 × the context length: far more than any array.
    const huge = '1000000000000';
    const { code, output, stderr } = await runToExit('worker', WORKER_MAIN, {
      MAX_BATCH_SIZE: huge,
      MAX_STEP_TOKENS: huge,
      KV_PREALLOCATE: '1',
      REDIS_URL: `redis://127.0.0.1:${await freePort()}`,
      METRICS_PORT: '0',
    });
    expect(code).toBe(1);
    const line = oneLine(stderr);
    expect(line).toMatch(/^worker cannot start the engine \(MAX_BATCH_SIZE=1000000000000, MAX_STEP_TOKENS=1000000000000, /);
    expect(line).toContain('KV_PREALLOCATE=true');
    expect(line).toMatch(/the model's context length: \d+\): /);
    expect(output).toContain('worker failed to start');
  });

  it('says in one line on stderr that it cannot connect to Redis, and why, without the password; exits 1', async () => {
    const port = await freePort();
    const { code, output, stderr } = await runToExit('gateway', GATEWAY_MAIN, { REDIS_URL: `redis://:${PASSWORD}@127.0.0.1:${port}` });
    expect(code).toBe(1);
    // It used to print only a JSON line saying "Connection is closed.".
    expect(oneLine(stderr)).toMatch(
      new RegExp(`^gateway cannot connect to Redis at redis://\\*\\*\\*@127\\.0\\.0\\.1:${port}: connect ECONNREFUSED`),
    );
    expect(output).not.toContain(PASSWORD);
  });

  it('stops the gateway with a message naming a port written in hexadecimal', async () => {
    const { code, output } = await runToExit('gateway', GATEWAY_MAIN, { PORT: '0x1F90' });
    expect(code).toBe(1);
    expect(output).toMatch(/PORT: must be a decimal integer/);
  });
});

describe('when the worker cannot start', () => {
  it('says in one line on stderr that it cannot connect to Redis, and why, without the password; exits 1', async () => {
    const port = await freePort();
    const { code, output, stderr } = await runToExit('worker', WORKER_MAIN, {
      REDIS_URL: `redis://:${PASSWORD}@127.0.0.1:${port}`,
      METRICS_PORT: '0',
    });
    expect(code).toBe(1);
    expect(oneLine(stderr)).toMatch(
      new RegExp(`^worker cannot connect to Redis at redis://\\*\\*\\*@127\\.0\\.0\\.1:${port}: connect ECONNREFUSED`),
    );
    // The JSON log line stays.
    expect(output).toMatch(/\{"level":60,.*"msg":"worker failed to start \(MODEL_DIR=built-in tiny/);
    expect(output).not.toContain(PASSWORD);
  });

  it('says in one line on stderr which MODEL_DIR it cannot load, and why; exits 1', async () => {
    const { code, stderr } = await runToExit('worker', WORKER_MAIN, { MODEL_DIR: `${root}no-such-model`, METRICS_PORT: '0' });
    expect(code).toBe(1);
    expect(oneLine(stderr)).toBe(`worker cannot load MODEL_DIR=${root}no-such-model: ${root}no-such-model: model directory not found`);
  });
});

describe.skipIf(!hasRedisServer())('when the gateway or the worker cannot start', () => {
  let redis: RedisServer;
  let locked: ManagedProcess;
  let lockedUrl: string;
  let lockedPort: number;
  let taken: Server;
  let takenPort: number;

  beforeAll(async () => {
    redis = await startRedis();
    const port = (lockedPort = await freePort());
    locked = startProcess(
      'redis (password)',
      'redis-server',
      ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--requirepass', PASSWORD],
      {},
    );
    lockedUrl = `redis://127.0.0.1:${port}`;
    await waitFor(
      'the password redis-server',
      async () => ((await runKeys(`redis://:${PASSWORD}@127.0.0.1:${port}`, ['list'])).code === 0 ? true : undefined),
      10_000,
      100,
    );
    taken = createServer();
    takenPort = await new Promise<number>((resolve) =>
      taken.listen(0, '127.0.0.1', () => resolve((taken.address() as { port: number }).port)),
    );
  });

  afterAll(async () => {
    taken?.close();
    await Promise.allSettled([redis?.stop(), locked?.stop()]);
  });

  it('the gateway says which PORT is in use and exits 1, without a stack trace', async () => {
    const { code, output } = await runToExit('gateway', GATEWAY_MAIN, {
      REDIS_URL: redis.url,
      HOST: '127.0.0.1',
      PORT: String(takenPort),
      AUTH: 'none',
    });
    expect(code).toBe(1);
    expect(output).toContain(`gateway cannot listen on HOST=127.0.0.1 PORT=${takenPort}: the port is already in use (EADDRINUSE)`);
    expect(output).not.toMatch(/Unhandled 'error' event|\n\s+at /);
  });

  it('the worker says which METRICS_PORT is in use, in one line on stderr, and exits 1', async () => {
    const { code, stderr } = await runToExit('worker', WORKER_MAIN, { REDIS_URL: redis.url, METRICS_PORT: String(takenPort) });
    expect(code).toBe(1);
    expect(oneLine(stderr)).toMatch(
      new RegExp(`^worker cannot listen on METRICS_HOST=127\\.0\\.0\\.1 METRICS_PORT=${takenPort}: .*EADDRINUSE`),
    );
  });

  it('the worker says in one line that Redis refused its password, without printing it', async () => {
    const { code, output, stderr } = await runToExit('worker', WORKER_MAIN, {
      REDIS_URL: `redis://:${PASSWORD}x@127.0.0.1:${lockedPort}`,
      METRICS_PORT: '0',
    });
    expect(code).toBe(1);
    expect(oneLine(stderr)).toMatch(
      new RegExp(`^worker cannot connect to Redis at redis://\\*\\*\\*@127\\.0\\.0\\.1:${lockedPort}: WRONGPASS`),
    );
    expect(output).not.toContain(PASSWORD);
  });

  it('the worker generates again a built-in model whose stamp outlived its model.onnx, and starts', async () => {
    const models = await mkdtemp(join(tmpdir(), 'sluice-models-'));
    try {
      await cp(`${root}models/tiny`, join(models, 'tiny'), { recursive: true });
      await rm(join(models, 'tiny', 'onnx', 'model.onnx'));
      const worker = await startWorker(redis.url, { SLUICE_MODELS_DIR: models });
      try {
        expect((await worker.health()).status).toBe('ok');
        expect(existsSync(join(models, 'tiny', 'onnx', 'model.onnx'))).toBe(true);
      } finally {
        await worker.process.stop();
      }
    } finally {
      await rm(models, { recursive: true, force: true });
    }
  });

  it('the gateway says which HOST it cannot bind and exits 1', async () => {
    // 192.0.2.1 (TEST-NET-1) is an address of no machine.
    const { code, output } = await runToExit('gateway', GATEWAY_MAIN, { REDIS_URL: redis.url, HOST: '192.0.2.1', PORT: '0', AUTH: 'none' });
    expect(code).toBe(1);
    expect(output).toMatch(/gateway cannot listen on HOST=192\.0\.2\.1 PORT=0: /);
    expect(output).not.toMatch(/Unhandled 'error' event/);
  });

  it('the gateway and the worker never print the Redis password', async () => {
    const url = `redis://:${PASSWORD}x@127.0.0.1:${lockedPort}/0`;
    const gateway = await runToExit('gateway', GATEWAY_MAIN, { REDIS_URL: url, HOST: '127.0.0.1', PORT: '0' });
    expect(gateway.code).toBe(1);
    expect(gateway.output).toContain(`gateway cannot connect to Redis at redis://***@127.0.0.1:${lockedPort}/0: WRONGPASS`);
    expect(gateway.output).not.toContain(PASSWORD);
    const worker = await runToExit('worker', WORKER_MAIN, { REDIS_URL: url, METRICS_PORT: '0', MODEL_DIR: `${root}no-such-model` });
    expect(worker.code).toBe(1);
    expect(worker.output).toContain('worker failed to start');
    expect(worker.output).not.toContain(PASSWORD);
  });

  it('the keys command says a wrong password is an authentication failure, without printing it', async () => {
    const wrong = await runKeys(lockedUrl.replace('redis://', `redis://:${PASSWORD}x@`), ['list']);
    expect(wrong.code).toBe(1);
    expect(wrong.stderr).toMatch(/refused to authenticate .*WRONGPASS/);
    expect(wrong.stderr).toContain('redis://***@127.0.0.1:');
    expect(wrong.stderr).not.toContain(PASSWORD);
    const none = await runKeys(lockedUrl, ['list']);
    expect(none.code).toBe(1);
    expect(none.stderr).toMatch(/refused to authenticate .*NOAUTH/);
  });

  it('the keys command says it cannot reach a Redis that is not there, without printing the password', async () => {
    const result = await runKeys(`redis://:${PASSWORD}@127.0.0.1:${await freePort()}`, ['list']);
    expect(result.code).toBe(1);
    expect(result.stderr).toMatch(/^keys: cannot reach Redis at redis:\/\/\*\*\*@127\.0\.0\.1:\d+: connect ECONNREFUSED/);
    expect(result.stderr).not.toContain(PASSWORD);
  });

  it('the keys command refuses a REDIS_URL that is not a Redis URL in one line', async () => {
    const result = await runKeys('http://x', ['list']);
    expect(result.code).toBe(1);
    expect(result.stderr).toBe('keys: invalid environment: REDIS_URL must be a redis:// or rediss:// URL\n');
  });
});

/** The live children of `pid`. */
function childrenOf(pid: number): number[] {
  try {
    return execFileSync('pgrep', ['-P', String(pid)], { encoding: 'utf8' })
      .trim()
      .split(/\s+/)
      .map(Number)
      .filter(isRunning);
  } catch {
    return []; // pgrep exits 1 when there is none
  }
}

function isRunning(pid: number): boolean {
  try {
    // A zombie counts as gone.
    return !/^\d+ \(.*\) Z/.test(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return false;
  }
}

describe.skipIf(!hasRedisServer())('npm start (scripts/start.mjs)', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await startRedis();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  /** Starts `command` (a shell line), waits until it serves, sends `signal` to it, returns the apps' pids. */
  async function startAndSignal(
    command: string,
    signal: NodeJS.Signals,
  ): Promise<{ apps: number[]; output: string; exit: { code: number | null } }> {
    const proc = startProcess('npm start', 'sh', ['-c', command], {
      REDIS_URL: redis.url,
      PORT: String(await freePort()),
      METRICS_PORT: String(await freePort()),
      LOG_LEVEL: 'warn',
    });
    let apps: number[] = [];
    try {
      await waitFor(
        `Sluice to start\n${proc.output()}`,
        () => (proc.output().includes('Sluice is running at') ? true : undefined),
        60_000,
        100,
      );
      // sh -c may have exec'd node itself (one command) or forked it.
      const starter = childrenOf(proc.pid).length === 2 ? proc.pid : (childrenOf(proc.pid)[0] ?? proc.pid);
      apps = childrenOf(starter);
      expect(apps).toHaveLength(2);
      proc.signal(signal);
      const timer = setTimeout(() => proc.signal('SIGKILL'), 20_000);
      const exit = await proc.exited;
      clearTimeout(timer);
      await waitFor(`the gateway and the worker to exit\n${proc.output()}`, () => (apps.some(isRunning) ? undefined : true), 15_000, 100);
      return { apps, output: proc.output(), exit };
    } finally {
      for (const pid of apps) if (isRunning(pid)) process.kill(pid, 'SIGKILL');
      await proc.stop(1_000);
    }
  }

  it('stops the gateway and the worker when its terminal hangs up (SIGHUP)', async () => {
    const { apps, output, exit } = await startAndSignal(`exec node ${root}scripts/start.mjs`, 'SIGHUP');
    expect(apps.filter(isRunning), output).toEqual([]);
    expect(exit.code).toBe(0);
  });

  it('says that requests need an API key when its Redis holds one already (it used to stop with a TypeError)', async () => {
    await createKey(redis.url, ['--name', 'existing']);
    try {
      const { output, exit } = await startAndSignal(`exec node ${root}scripts/start.mjs`, 'SIGHUP');
      expect(output).toContain('-H "Authorization: Bearer $SLUICE_API_KEY"');
      // The keys command for the Redis it uses (`npm run keys` alone goes to 127.0.0.1:6379).
      expect(output).toContain(`REDIS_URL=${redis.url} npm run keys -- create --name <name>`);
      expect(exit.code).toBe(0);
    } finally {
      await runKeys(redis.url, ['revoke', '--name', 'existing']);
    }
  });

  it('passes the SIGTERM that npm sends on to start.mjs, which stops the gateway and the worker', async () => {
    const script = (JSON.parse(readFileSync(`${root}package.json`, 'utf8')) as { scripts: { start: string } }).scripts.start;
    // The build is someone else's test: here it already ran.
    const command = script.replace('turbo run build', 'true');
    expect(command).not.toBe(script);
    const { apps, output } = await startAndSignal(`cd ${root} && ${command}`, 'SIGTERM');
    expect(apps.filter(isRunning), output).toEqual([]);
  });
});
