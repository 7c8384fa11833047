/**
 * Starting and stopping the real processes of an end-to-end test: free ports, child processes with
 * their output kept for failure messages, and a watchdog so nothing outlives the test process.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import { inspect } from 'node:util';

/** A port that was free a moment ago on 127.0.0.1. */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      const port = typeof address === 'object' && address !== null ? address.port : 0;
      server.close(() => resolve(port));
    });
  });
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** Polls `check` until it returns a value other than undefined, or throws after `timeoutMs`. */
export async function waitFor<T>(
  what: string,
  check: () => Promise<T | undefined> | T | undefined,
  timeoutMs = 20_000,
  everyMs = 25,
): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let lastError: unknown;
  for (;;) {
    try {
      const value = await check();
      if (value !== undefined) return value;
    } catch (error) {
      lastError = error;
    }
    if (Date.now() > deadline) {
      throw new Error(
        `timed out after ${timeoutMs} ms waiting for ${what}${lastError === undefined ? '' : `: ${lastError instanceof Error ? lastError.message : inspect(lastError)}`}`,
      );
    }
    await sleep(everyMs);
  }
}

export interface ManagedProcess {
  readonly name: string;
  readonly child: ChildProcess;
  readonly pid: number;
  /** Resolves with the exit code (null when killed by a signal) and the signal. */
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  /** The last ~64 KiB of stdout + stderr. */
  output(): string;
  /** Sends a signal (no-op once exited). */
  signal(signal: NodeJS.Signals): void;
  /** SIGTERM, then SIGKILL after `graceMs`; resolves once the process is gone. */
  stop(graceMs?: number): Promise<void>;
}

const OUTPUT_LIMIT = 64 * 1024;
const running = new Set<ManagedProcess>();
process.once('exit', () => {
  for (const proc of running) proc.child.kill('SIGKILL');
});

/** Spawns a process; it is killed when the test process exits, even by a signal (watchdog). */
export function startProcess(name: string, command: string, args: readonly string[], env: Record<string, string>): ManagedProcess {
  const child = spawn(command, args, { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  let output = '';
  const append = (text: string) => {
    output += text;
    if (output.length > OUTPUT_LIMIT) output = output.slice(-OUTPUT_LIMIT);
  };
  child.stdout?.setEncoding('utf8').on('data', append);
  child.stderr?.setEncoding('utf8').on('data', append);
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => {
    child.once('exit', (code, signal) => resolve({ code, signal }));
    child.once('error', (error) => {
      append(`spawn error: ${error.message}\n`);
      resolve({ code: null, signal: null });
    });
  });
  const watchdog = spawn(
    'sh',
    [
      '-c',
      `while kill -0 ${process.pid} 2>/dev/null && kill -0 ${child.pid} 2>/dev/null; do sleep 1; done; kill -KILL ${child.pid} 2>/dev/null`,
    ],
    { stdio: 'ignore', detached: true },
  );
  watchdog.unref();
  let gone = false;
  const managed: ManagedProcess = {
    name,
    child,
    pid: child.pid ?? -1,
    exited,
    output: () => output,
    signal: (signal) => {
      if (!gone) child.kill(signal);
    },
    stop: async (graceMs = 5_000) => {
      if (!gone) {
        child.kill('SIGTERM');
        const timer = setTimeout(() => child.kill('SIGKILL'), graceMs);
        await exited;
        clearTimeout(timer);
      }
    },
  };
  void exited.then(() => {
    gone = true;
    running.delete(managed);
    watchdog.kill('SIGKILL');
  });
  running.add(managed);
  return managed;
}
