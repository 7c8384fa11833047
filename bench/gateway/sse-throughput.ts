/**
 * SSE events/s delivered to N concurrent streams: the gateway's HTTP path vs a minimal `node:http`
 * writer, each in its own server process, measured by the same client process, alternating rounds.
 */
import { spawn, spawnSync } from 'node:child_process';
import { availableParallelism } from 'node:os';
import { fileURLToPath } from 'node:url';

const here = fileURLToPath(new URL('.', import.meta.url));

export interface ThroughputRound {
  mode: 'baseline' | 'gateway';
  eventsPerSecond: number;
  seconds: number;
  dataFrames: number;
  /** Content events per second of the server's own CPU time (user + system), after the warm-up. */
  eventsPerCpuSecond: number;
  /** The same over the warm-up's steps, the first after the streams opened (undefined without a warm-up). */
  coldEventsPerCpuSecond: number | undefined;
}

/** Server and client each get their own core when the machine has two and `taskset` exists. */
export const PINNED = availableParallelism() >= 2 && spawnSync('taskset', ['-c', '0', 'true']).status === 0;

function runNode(args: string[], core: number, onLine?: (line: string) => void): { done: Promise<string>; kill: () => void } {
  const node = [process.execPath, '--import', 'tsx', ...args];
  const [command, ...rest] = PINNED ? ['taskset', '-c', String(core), ...node] : node;
  const child = spawn(command!, rest, { stdio: ['ignore', 'pipe', 'inherit'] });
  let out = '';
  child.stdout.setEncoding('utf8').on('data', (text: string) => {
    out += text;
    for (const line of text.split('\n')) if (line !== '') onLine?.(line);
  });
  const done = new Promise<string>((resolve, reject) => {
    child.once('exit', (code) => (code === 0 || code === null ? resolve(out) : reject(new Error(`${args[0]} exited ${code}`))));
  });
  return { done, kill: () => child.kill('SIGKILL') };
}

/**
 * One round: a fresh server process of `mode`, `warmup` steps of one event per stream, then `events`
 * measured ones.
 */
export async function measureRound(
  mode: ThroughputRound['mode'],
  streams: number,
  events: number,
  stepMs = 0,
  warmup = 0,
): Promise<ThroughputRound> {
  let resolvePort!: (port: number) => void;
  const port = new Promise<number>((resolve) => (resolvePort = resolve));
  let resolveCpu!: (cpuMicros: { measured: number; cold: number }) => void;
  const cpu = new Promise<{ measured: number; cold: number }>((resolve) => (resolveCpu = resolve));
  const server = runNode([`${here}sse-server.ts`, mode, String(streams), String(events), String(stepMs), String(warmup)], 0, (line) => {
    const match = /^port (\d+)$/.exec(line);
    if (match) resolvePort(Number(match[1]));
    const cpuMatch = /^cpu (\d+) cold (\d+)/.exec(line);
    if (cpuMatch) resolveCpu({ measured: Number(cpuMatch[1]), cold: Number(cpuMatch[2]) });
  });
  try {
    const url = `http://127.0.0.1:${await port}`;
    const client = runNode([`${here}sse-client.ts`, url, String(streams)], 1);
    const result = JSON.parse((await client.done).trim()) as { events: number; seconds: number };
    // Content events only (the gateway also sends a role and a finish chunk per stream).
    const { measured, cold } = await cpu;
    return {
      mode,
      eventsPerSecond: (streams * (warmup + events)) / result.seconds,
      seconds: result.seconds,
      dataFrames: result.events,
      eventsPerCpuSecond: (streams * events) / (measured / 1e6),
      coldEventsPerCpuSecond: warmup > 0 ? (streams * warmup) / (cold / 1e6) : undefined,
    };
  } finally {
    server.kill();
    await server.done.catch(() => undefined);
  }
}
