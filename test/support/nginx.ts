/**
 * Runs a real nginx (the Debian package; `.ci/run` installs it) in front of local servers, for
 * end-to-end tests. The generated config defines the upstream and the runtime paths only: the proxy
 * settings are `deploy/nginx/sluice-proxy.conf`, the same file the compose deployment uses. Every
 * path nginx writes (pid, logs, temp files) is in a fresh temp dir, so nothing under /etc or /var is
 * read or touched.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { accessSync, constants } from 'node:fs';
import { mkdtemp, open, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer, connect } from 'node:net';
import { tmpdir } from 'node:os';
import { delimiter, join } from 'node:path';
import { fileURLToPath } from 'node:url';

/** The proxy settings shared with the deployment. */
export const SLUICE_PROXY_CONF = fileURLToPath(new URL('../../deploy/nginx/sluice-proxy.conf', import.meta.url));

export interface StartNginxOptions {
  /** Ports on 127.0.0.1 of the servers to balance over (the gateways). */
  upstreamPorts: readonly number[];
  /** Port to listen on, on 127.0.0.1. @defaultValue a free port */
  port?: number;
  /** How long to wait for nginx to accept connections. @defaultValue 10000 */
  startTimeoutMs?: number;
}

export interface NginxServer {
  /** Where nginx listens: `http://127.0.0.1:PORT`. */
  readonly url: string;
  readonly port: number;
  /** The temp dir holding the config, pid file, logs and temp files. */
  readonly dir: string;
  /** The error log so far (useful in a failing test's message). */
  errorLog(): Promise<string>;
  /** The access log so far: one line per request, with the upstream that served it. */
  accessLog(): Promise<string>;
  /** Stops nginx (fast shutdown: open streams are cut) and removes the temp dir. */
  close(): Promise<void>;
}

/** Starts nginx as a foreground process and resolves once it accepts connections. */
export async function startNginx(options: StartNginxOptions): Promise<NginxServer> {
  if (options.upstreamPorts.length === 0) throw new Error('startNginx: no upstream ports');
  const binary = findNginx();
  const port = options.port ?? (await freePort());
  const dir = await mkdtemp(join(tmpdir(), 'sluice-nginx-'));
  const confPath = join(dir, 'nginx.conf');
  await writeFile(confPath, nginxConfig({ dir, port, upstreamPorts: options.upstreamPorts }));

  // -e: the error log from the first line on (before the config is read); -p: the prefix for any
  // relative path, so none falls back to the package's compiled-in /usr/share/nginx.
  const child = spawn(binary, ['-p', dir, '-e', join(dir, 'error.log'), '-c', confPath], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let stderr = '';
  child.stderr?.setEncoding('utf8').on('data', (text: string) => (stderr += text));
  const exited = new Promise<number | null>((resolve) => {
    child.once('exit', (code) => resolve(code));
    child.once('error', () => resolve(null));
  });
  // Do not leave nginx behind if the test process ends without calling close(): on process.exit,
  // and, since a test runner may end its workers with a signal (no 'exit' event then), through a
  // watchdog shell that stops nginx once this process is gone.
  const killOnExit = () => child.kill('SIGTERM');
  process.once('exit', killOnExit);
  const watchdog = spawn(
    'sh',
    ['-c', `while kill -0 ${process.pid} 2>/dev/null; do sleep 1; done; kill -TERM ${child.pid}; sleep 1; rm -rf '${dir}'`],
    { stdio: 'ignore', detached: true },
  );
  watchdog.unref();

  const readLog = (name: string) => readFile(join(dir, name), 'utf8').catch(() => '');
  const close = async () => {
    process.removeListener('exit', killOnExit);
    watchdog.kill('SIGKILL');
    await stop(child, exited);
    await rm(dir, { recursive: true, force: true });
  };

  let gone = false;
  void exited.then(() => (gone = true));
  // nginx writes its pid file after binding its sockets: that, not a connect alone (another process
  // may hold the port), says this nginx is the one listening.
  const pidWritten = async () => (await readLog('nginx.pid')).trim() === String(child.pid);
  const ready = await waitUntil(
    async () => (await pidWritten()) && (await accepts(port)),
    options.startTimeoutMs ?? 10_000,
    () => gone,
  );
  if (!ready) {
    const log = await readLog('error.log');
    await close();
    throw new Error(`nginx did not start:\n${stderr}${log}`);
  }
  return {
    url: `http://127.0.0.1:${port}`,
    port,
    dir,
    errorLog: () => readLog('error.log'),
    accessLog: () => readLog('access.log'),
    close,
  };
}

/** The generated main config: runtime paths in `dir`, the upstream, and the shared proxy settings. */
export function nginxConfig({ dir, port, upstreamPorts }: { dir: string; port: number; upstreamPorts: readonly number[] }): string {
  const servers = upstreamPorts.map((p) => `        server 127.0.0.1:${p} max_fails=1 fail_timeout=2s;`).join('\n');
  return `${userLine()}daemon off;
worker_processes 1;
pid ${dir}/nginx.pid;
error_log ${dir}/error.log info;

events {
    worker_connections 1024;
}

http {
    log_format sluice '$remote_addr "$request" $status $body_bytes_sent $request_time '
                      'upstream=$upstream_addr upstream_status=$upstream_status request_id=$sluice_request_id';
    access_log ${dir}/access.log sluice;
${tempPaths(dir)}

    upstream sluice_gateways {
        least_conn;
${servers}
        keepalive 16;
    }

    server {
        listen 127.0.0.1:${port};
        include ${SLUICE_PROXY_CONF};
    }
}
`;
}

/** As root, nginx would switch its workers to `nobody`, which cannot write to a 0700 temp dir. */
function userLine(): string {
  return process.getuid?.() === 0 ? 'user root root;\n' : '';
}

/** Temp paths in `dir`: the package's compiled-in ones are under /var/lib/nginx. */
function tempPaths(dir: string): string {
  return ['client_body', 'proxy', 'fastcgi', 'uwsgi', 'scgi'].map((name) => `    ${name}_temp_path ${dir}/${name};`).join('\n');
}

/**
 * Runs `nginx -t` on a main config (the text of an nginx.conf), with its runtime paths in a temp dir.
 * Resolves with nginx's output; rejects with it when the config is invalid.
 */
export async function checkNginxConfig(config: string): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), 'sluice-nginx-t-'));
  try {
    const confPath = join(dir, 'nginx.conf');
    await writeFile(confPath, userLine() + config.replace(/^http \{$/m, `http {\n${tempPaths(dir)}`));
    // Output to a file, not a pipe: a config that logs to /dev/stdout cannot open a socket there.
    const outputPath = join(dir, 'output.log');
    const output = await open(outputPath, 'w');
    const child = spawn(findNginx(), ['-t', '-p', dir, '-e', join(dir, 'error.log'), '-g', `pid ${dir}/nginx.pid;`, '-c', confPath], {
      stdio: ['ignore', output.fd, output.fd],
    });
    const code = await new Promise<number | null>((resolve) => child.once('close', resolve));
    await output.close();
    const text = await readFile(outputPath, 'utf8');
    if (code !== 0) throw new Error(`nginx -t failed:\n${text}`);
    return text;
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

/** `NGINX_BIN`, else `nginx` on PATH, else the Debian location (root's PATH may lack /usr/sbin). */
function findNginx(): string {
  const candidates = [
    process.env['NGINX_BIN'],
    ...(process.env['PATH'] ?? '').split(delimiter).map((d) => (d === '' ? undefined : join(d, 'nginx'))),
    '/usr/sbin/nginx',
    '/usr/local/sbin/nginx',
  ];
  for (const candidate of candidates) {
    if (candidate === undefined) continue;
    try {
      accessSync(candidate, constants.X_OK);
      return candidate;
    } catch {
      // try the next one
    }
  }
  throw new Error('nginx not found: install it (apt-get install -y nginx; .ci/run does) or set NGINX_BIN');
}

async function stop(child: ChildProcess, exited: Promise<number | null>): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  child.kill('SIGTERM'); // fast shutdown: SIGQUIT would wait for open streams to end
  const timer = setTimeout(() => child.kill('SIGKILL'), 5000);
  await exited;
  clearTimeout(timer);
}

/** A port that was free a moment ago on 127.0.0.1. */
function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      server.close(() => (typeof address === 'object' && address !== null ? resolve(address.port) : reject(new Error('no port'))));
    });
  });
}

/** True once `check()` is; false on timeout or once `gone()` says so. */
async function waitUntil(check: () => Promise<boolean>, timeoutMs: number, gone: () => boolean): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (!gone() && Date.now() < deadline) {
    if (await check()) return !gone();
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  return false;
}

function accepts(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect(port, '127.0.0.1');
    socket.once('connect', () => {
      socket.destroy();
      resolve(true);
    });
    socket.once('error', () => resolve(false));
  });
}
