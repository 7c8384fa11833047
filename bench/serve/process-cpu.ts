/**
 * CPU time of processes and threads, read from /proc (Linux): what each part of a stack spends per
 * token. On a machine whose cores the engine's threads already fill, CPU spent anywhere else in the
 * stack is taken from the engine.
 */
import { readFileSync } from 'node:fs';

/** Clock ticks per second of /proc's utime and stime (Linux's USER_HZ, 100 on every common build). */
const TICKS_PER_SECOND = 100;

/** utime + stime of /proc/<path>/stat, in seconds; 0 once the process is gone. */
function statSeconds(path: string): number {
  let text: string;
  try {
    text = readFileSync(`/proc/${path}/stat`, 'utf8');
  } catch {
    return 0;
  }
  // Fields after the command name (which may hold spaces) in parentheses: utime is the 14th field, stime the 15th.
  const fields = text.slice(text.lastIndexOf(')') + 2).split(' ');
  return (Number(fields[11]) + Number(fields[12])) / TICKS_PER_SECOND;
}

/** A process's CPU seconds (all threads), and its main thread's alone. */
export function processCpu(pid: number): { total: number; mainThread: number } {
  return { total: statSeconds(String(pid)), mainThread: statSeconds(`${pid}/task/${pid}`) };
}

/** The calling process's own CPU seconds. */
export function ownCpu(): number {
  const usage = process.cpuUsage();
  return (usage.user + usage.system) / 1e6;
}
