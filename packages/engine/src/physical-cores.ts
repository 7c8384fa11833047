/**
 * How many CPU cores (not SMT siblings) this process may run on, from the kernel's CPU topology.
 *
 * The engine's default for onnxruntime's intra-op threads. onnxruntime's own default means the same
 * (one thread per physical core) but counts the cores with cpuinfo, which on this project's 2-vCPU
 * AMD EPYC VMs (family 26) counted one of the two: every decode ran on one core (docs/engine.md,
 * "Threads"). The kernel's topology, `core_id` per `physical_package_id`, says two there.
 *
 * Only the CPUs of the process's affinity mask count (`Cpus_allowed_list`, e.g. under `taskset` or a
 * cpuset). A container's CPU quota (`--cpus`) is not read: set the thread count there.
 * Returns 0 (onnxruntime's default) where the topology cannot be read (not Linux).
 */
import { readFileSync, readdirSync } from 'node:fs';

export function physicalCores(sysCpu = '/sys/devices/system/cpu', status = '/proc/self/status'): number {
  let allowed: Set<number> | undefined;
  try {
    const line = /^Cpus_allowed_list:\s*(.+)$/m.exec(readFileSync(status, 'utf8'))?.[1];
    if (line !== undefined) allowed = parseCpuList(line);
  } catch {
    // No /proc: every CPU counts.
  }
  let names: string[];
  try {
    names = readdirSync(sysCpu);
  } catch {
    return 0;
  }
  const cores = new Set<string>();
  for (const name of names) {
    const cpu = /^cpu(\d+)$/.exec(name)?.[1];
    if (cpu === undefined || (allowed !== undefined && !allowed.has(Number(cpu)))) continue;
    try {
      const core = readFileSync(`${sysCpu}/${name}/topology/core_id`, 'utf8').trim();
      const pkg = readFileSync(`${sysCpu}/${name}/topology/physical_package_id`, 'utf8').trim();
      cores.add(`${pkg}:${core}`);
    } catch {
      // An offline CPU has no topology.
    }
  }
  return cores.size;
}

/** `0-3,8,10-11` → {0, 1, 2, 3, 8, 10, 11}. */
export function parseCpuList(list: string): Set<number> {
  const cpus = new Set<number>();
  for (const part of list.trim().split(',')) {
    const [from, to = from] = part.split('-').map(Number);
    if (from === undefined || to === undefined || !Number.isInteger(from) || !Number.isInteger(to)) continue;
    for (let cpu = from; cpu <= to; cpu++) cpus.add(cpu);
  }
  return cpus;
}
