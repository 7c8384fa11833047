/**
 * llama.cpp's `llama-server` as the peer of `npm run bench:serve`: started on a GGUF file of the same
 * generated weights (`npm run model:generate -- --format gguf`), on loopback, with the slots and
 * context the workloads need and the caller's extra arguments.
 */
import { spawn, type ChildProcess } from 'node:child_process';

export interface PeerServer {
  url: string;
  pid: number;
  /** What `llama-server --version` printed (its build number and commit). */
  version: string;
  /** The end of what it printed (for a failure's message). */
  logTail(): string;
  stop(): Promise<void>;
}

async function versionOf(binary: string): Promise<string> {
  const child = spawn(binary, ['--version'], { stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  child.stdout.on('data', (text: Buffer) => (out += text.toString()));
  child.stderr.on('data', (text: Buffer) => (out += text.toString()));
  await new Promise((resolve) => child.once('exit', resolve));
  return (out.match(/version: .*/)?.[0] ?? out.trim().split('\n').at(-1) ?? 'unknown').trim();
}

export async function startLlamaServer(options: {
  binary: string;
  gguf: string;
  port: number;
  slots: number;
  /** Context over all slots (each slot gets contextTokens / slots). */
  contextTokens: number;
  threads: number;
  extraArgs: readonly string[];
}): Promise<PeerServer> {
  const version = await versionOf(options.binary);
  const args = [
    ...['-m', options.gguf, '--host', '127.0.0.1', '--port', String(options.port)],
    ...['-np', String(options.slots), '-c', String(options.contextTokens)],
    ...['-t', String(options.threads), '-tb', String(options.threads)],
    ...options.extraArgs,
  ];
  const child: ChildProcess = spawn(options.binary, args, { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  child.stderr!.on('data', (text: Buffer) => {
    log = (log + text.toString()).slice(-20_000);
  });
  const exited = new Promise<void>((resolve) =>
    child.once('exit', (code, signal) => {
      log += `\n[llama-server exited: ${signal ?? code}]\n`;
      resolve();
    }),
  );
  process.once('exit', () => child.kill('SIGKILL'));
  const url = `http://127.0.0.1:${options.port}`;
  const deadline = Date.now() + 120_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`llama-server exited (${child.exitCode}):\n${log}`);
    const ok = await fetch(`${url}/health`)
      .then((res) => res.status === 200)
      .catch(() => false);
    if (ok) break;
    if (Date.now() > deadline) {
      child.kill('SIGKILL');
      throw new Error(`llama-server did not become healthy in 120 s:\n${log}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
  return {
    url,
    pid: child.pid ?? -1,
    version,
    logTail: () => log.slice(-4_000),
    stop: async () => {
      if (child.exitCode === null) child.kill('SIGTERM');
      const timer = setTimeout(() => child.kill('SIGKILL'), 5_000);
      await exited;
      clearTimeout(timer);
    },
  };
}
