import { mkdtemp, mkdir, rm, writeFile } from 'node:fs/promises';
import { availableParallelism, tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { parseCpuList, physicalCores } from '../src/physical-cores.js';

let root: string | undefined;
afterEach(async () => {
  if (root !== undefined) await rm(root, { recursive: true, force: true });
  root = undefined;
});

/** A sysfs-like tree: cpuN → [package, core] (undefined: offline, no topology), and a status file. */
async function machine(cpus: Array<[number, number] | undefined>, allowed?: string): Promise<{ sys: string; status: string }> {
  root = await mkdtemp(join(tmpdir(), 'sluice-cores-'));
  const sys = join(root, 'cpu');
  await mkdir(join(sys, 'cpufreq'), { recursive: true });
  for (const [i, topology] of cpus.entries()) {
    await mkdir(join(sys, `cpu${i}`), { recursive: true });
    if (topology === undefined) continue;
    await mkdir(join(sys, `cpu${i}`, 'topology'));
    await writeFile(join(sys, `cpu${i}`, 'topology', 'physical_package_id'), `${topology[0]}\n`);
    await writeFile(join(sys, `cpu${i}`, 'topology', 'core_id'), `${topology[1]}\n`);
  }
  const status = join(root, 'status');
  await writeFile(status, `Name:\tnode\n${allowed === undefined ? '' : `Cpus_allowed_list:\t${allowed}\n`}Threads:\t7\n`);
  return { sys, status };
}

describe('physicalCores', () => {
  it('counts each core once, whatever its SMT siblings', async () => {
    const { sys, status } = await machine([
      [0, 0],
      [0, 1],
      [0, 0],
      [0, 1],
    ]);
    expect(physicalCores(sys, status)).toBe(2);
  });

  it('tells cores of different packages apart', async () => {
    const { sys, status } = await machine([
      [0, 0],
      [1, 0],
    ]);
    expect(physicalCores(sys, status)).toBe(2);
  });

  it('counts only the CPUs the process may run on, and skips offline ones', async () => {
    const { sys, status } = await machine([[0, 0], [0, 1], [0, 2], undefined], '1-3');
    expect(physicalCores(sys, status)).toBe(2);
  });

  it('returns 0 (onnxruntime decides) where there is no topology to read', () => {
    expect(physicalCores('/nonexistent/sys/cpu', '/nonexistent/status')).toBe(0);
  });

  it.runIf(process.platform === 'linux')('reads this machine: at least one core, at most the CPUs it may use', () => {
    const cores = physicalCores();
    expect(cores).toBeGreaterThanOrEqual(1);
    expect(cores).toBeLessThanOrEqual(availableParallelism());
  });
});

describe('parseCpuList', () => {
  it('reads ranges and single CPUs', () => {
    expect([...parseCpuList('0-3,8,10-11\n')]).toEqual([0, 1, 2, 3, 8, 10, 11]);
    expect([...parseCpuList('5')]).toEqual([5]);
  });
});
