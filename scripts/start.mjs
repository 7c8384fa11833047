#!/usr/bin/env node
/**
 * `npm start`: one gateway and one worker on the built-in tiny model (or MODEL_DIR), on Redis at
 * REDIS_URL — or, when REDIS_URL is unset and nothing answers on 127.0.0.1:6379, on a private
 * `redis-server` started here. Prints the URL and a curl example; Ctrl-C (or SIGTERM, SIGHUP) stops everything.
 * Expects the apps to be built (`npm start` builds first).
 */
import { spawn, spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { connect, createServer } from 'node:net';
import { fileURLToPath } from 'node:url';

const root = fileURLToPath(new URL('..', import.meta.url));
const GATEWAY = `${root}apps/gateway/dist/main.js`;
const WORKER = `${root}apps/worker/dist/main.js`;
const children = [];

function log(message) {
  process.stdout.write(`[start] ${message}\n`);
}

function fail(message) {
  process.stderr.write(`[start] ${message}\n`);
  void stopAll(1);
}

/** True when something at `url` answers like Redis (any RESP reply, even NOAUTH). */
function redisAnswers(url) {
  const { hostname, port } = new URL(url);
  return new Promise((resolve) => {
    const socket = connect({ host: hostname || '127.0.0.1', port: Number(port || 6379) });
    const done = (ok) => {
      socket.destroy();
      resolve(ok);
    };
    socket.setTimeout(1000, () => done(false));
    socket.once('error', () => done(false));
    socket.once('connect', () => socket.write('PING\r\n'));
    socket.once('data', (data) => done(/^[+-]/.test(data.toString())));
  });
}

function freePort() {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function run(name, command, args, env) {
  // Own process group: Ctrl-C reaches only this script, which stops the apps first (they drain)
  // and Redis last.
  const child = spawn(command, args, { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  const prefix = (stream, out) => {
    let rest = '';
    stream.setEncoding('utf8').on('data', (text) => {
      const lines = (rest + text).split('\n');
      rest = lines.pop() ?? '';
      for (const line of lines) out.write(`[${name}] ${line}\n`);
    });
  };
  prefix(child.stdout, process.stdout);
  prefix(child.stderr, process.stderr);
  child.on('exit', (code, signal) => {
    if (!stopping) fail(`${name} exited (${signal ?? `code ${code}`}); stopping everything.`);
  });
  children.push({ name, child });
  return child;
}

let stopping = false;
async function stopAll(code) {
  if (stopping) return;
  stopping = true;
  // Apps first (they drain), Redis last.
  for (const { child } of [...children].reverse().filter(({ name }) => name !== 'redis')) child.kill('SIGTERM');
  await Promise.all(children.filter(({ name }) => name !== 'redis').map(({ child }) => exited(child, 10_000)));
  for (const { child } of children.filter(({ name }) => name === 'redis')) {
    child.kill('SIGTERM');
    await exited(child, 5_000);
  }
  process.exit(code);
}

function exited(child, graceMs) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(() => child.kill('SIGKILL'), graceMs);
    child.once('exit', () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

process.on('SIGINT', () => void stopAll(0));
process.on('SIGTERM', () => void stopAll(0));
// A closed terminal or an SSH session that ends: the children are in their own sessions and get no
// SIGHUP of their own, and Node's default (die at once) would run no 'exit' handler and leave them.
process.on('SIGHUP', () => void stopAll(0));
// Whatever happens to this script, its children do not outlive it.
process.on('exit', () => {
  for (const { child } of children) if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
});

async function main() {
  for (const path of [GATEWAY, WORKER]) {
    if (!existsSync(path)) return fail(`${path} is missing: run \`npm run build\` first (\`npm start\` does).`);
  }

  let redisUrl = process.env.REDIS_URL;
  if (redisUrl !== undefined && redisUrl !== '') {
    if (!(await redisAnswers(redisUrl)))
      return fail(`REDIS_URL=${redisUrl} does not answer. Start that Redis, or unset REDIS_URL to use a local one.`);
    log(`using Redis at ${redisUrl}`);
  } else if (await redisAnswers('redis://127.0.0.1:6379')) {
    redisUrl = 'redis://127.0.0.1:6379';
    log(`using the Redis already running at ${redisUrl}`);
  } else {
    if (spawnSync('redis-server', ['--version']).status !== 0) {
      return fail(
        'No Redis to use: REDIS_URL is unset, nothing answers on 127.0.0.1:6379, and `redis-server` is not installed.\n' +
          '        Install it (Debian/Ubuntu: `sudo apt-get install redis-server`, macOS: `brew install redis`) or set REDIS_URL=redis://host:port.',
      );
    }
    const port = await freePort();
    redisUrl = `redis://127.0.0.1:${port}`;
    run(
      'redis',
      'redis-server',
      [
        '--port',
        String(port),
        '--bind',
        '127.0.0.1',
        '--save',
        '',
        '--appendonly',
        'no',
        '--maxmemory-policy',
        'noeviction',
        '--loglevel',
        'warning',
      ],
      {},
    );
    for (let i = 0; !(await redisAnswers(redisUrl)); i++) {
      if (i > 100) return fail('the local redis-server did not start.');
      await sleep(50);
    }
    log(`started a local redis-server at ${redisUrl} (in memory, stopped with this command)`);
  }

  const port = process.env.PORT ?? '8080';
  const metricsPort = process.env.METRICS_PORT ?? String(await freePort());
  run('worker', process.execPath, [WORKER], { REDIS_URL: redisUrl, METRICS_PORT: metricsPort });
  // Loopback unless HOST says otherwise: with no API key, a gateway on a public address refuses to
  // start (AUTH), and one on loopback serves without keys, as a local try-out should.
  const host = process.env.HOST ?? '127.0.0.1';
  run('gateway', process.execPath, [GATEWAY], { REDIS_URL: redisUrl, PORT: port, HOST: host });

  const url = `http://127.0.0.1:${port}`;
  log('waiting for the gateway to see a live worker (the first run generates the tiny model)...');
  for (let i = 0; ; i++) {
    if (stopping) return;
    try {
      if ((await fetch(`${url}/readyz`)).status === 200) break;
    } catch {
      // not listening yet
    }
    if (i > 1200) return fail('the gateway did not become ready within 2 minutes.');
    await sleep(100);
  }
  // A Redis that holds API keys already (created with `npm run keys`) makes the gateway require one.
  const listed = await fetch(`${url}/v1/models`);
  const keyed = listed.status === 401;
  const models = listed.ok ? (await listed.json()).data.map((m) => m.id) : [];
  const model = models[0] ?? process.env.MODEL_ID ?? 'tiny';
  // `npm run keys` reads REDIS_URL (default 127.0.0.1:6379): the private Redis's URL goes with it.
  const keysCommand = `${redisUrl === 'redis://127.0.0.1:6379' ? '' : `REDIS_URL=${redisUrl} `}npm run keys -- create --name <name>`;
  process.stdout.write(
    `\nSluice is running at ${url}  (model: ${model}; Ctrl-C stops everything)\n\n` +
      `  curl -N ${url}/v1/chat/completions -H 'Content-Type: application/json' \\\n` +
      (keyed ? `    -H "Authorization: Bearer $SLUICE_API_KEY" \\\n` : '') +
      `    -d '{"model":"${model}","messages":[{"role":"user","content":"Hello!"}],"max_tokens":32,"stream":true}'\n\n` +
      (keyed
        ? `This Redis holds API keys, so every request needs one (SLUICE_API_KEY above). A new key: ${keysCommand}\n\n`
        : `API keys (requests need one once any exists): ${keysCommand}\n\n`),
  );
}

main().catch((error) => fail(String(error?.stack ?? error)));
