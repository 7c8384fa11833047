/** A private Prometheus server (Debian's `prometheus`) on a free loopback port, for dashboard tests. */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { freePort, startProcess, waitFor, type ManagedProcess } from './processes.js';

export interface PrometheusServer {
  readonly url: string;
  readonly process: ManagedProcess;
  /** An instant query; throws on a query error. */
  query(expr: string): Promise<Array<{ metric: Record<string, string>; value: [number, string] }>>;
  /** `GET /api/v1/rules`: every rule group with each rule's health, last error and (alerts) state. */
  rules(): Promise<
    Array<{
      name: string;
      rules: Array<{ name: string; type: 'recording' | 'alerting'; health: string; lastError?: string; state?: string; query: string }>;
    }>
  >;
  stop(): Promise<void>;
}

export function hasPrometheus(): boolean {
  return spawnSync('prometheus', ['--version']).status === 0;
}

export function hasPromtool(): boolean {
  return spawnSync('promtool', ['--version']).status === 0;
}

/** Runs `promtool` with `args` in `cwd`; resolves with its exit status and output. */
export function promtool(args: readonly string[], cwd?: string): { status: number | null; output: string } {
  const result = spawnSync('promtool', args, { cwd, encoding: 'utf8' });
  return { status: result.status, output: `${result.stdout}${result.stderr}` };
}

/**
 * Starts Prometheus on `config` (YAML text; relative `rule_files` resolve against `dir` of the files
 * given in `files`, written next to it) and waits until it is ready.
 */
export async function startPrometheus(config: string, files: Record<string, string> = {}): Promise<PrometheusServer> {
  const dir = mkdtempSync(join(tmpdir(), 'sluice-prometheus-'));
  for (const [name, text] of Object.entries(files)) writeFileSync(join(dir, name), text);
  writeFileSync(join(dir, 'prometheus.yml'), config);
  const port = await freePort();
  const proc = startProcess(
    'prometheus',
    'prometheus',
    [
      `--config.file=${join(dir, 'prometheus.yml')}`,
      `--storage.tsdb.path=${join(dir, 'data')}`,
      `--web.listen-address=127.0.0.1:${port}`,
      '--log.level=warn',
    ],
    {},
  );
  const url = `http://127.0.0.1:${port}`;
  await waitFor(`prometheus ready\n${proc.output()}`, async () => ((await fetch(`${url}/-/ready`)).ok ? true : undefined), 30_000, 100);
  const api = async <T>(path: string): Promise<T> => {
    const res = await fetch(`${url}${path}`);
    const body = (await res.json()) as { status: string; data: T; error?: string };
    if (body.status !== 'success') throw new Error(`${path}: ${body.error ?? res.status}`);
    return body.data;
  };
  return {
    url,
    process: proc,
    query: async (expr) =>
      (
        await api<{ result: Array<{ metric: Record<string, string>; value: [number, string] }> }>(
          `/api/v1/query?query=${encodeURIComponent(expr)}`,
        )
      ).result,
    rules: async () => (await api<{ groups: Awaited<ReturnType<PrometheusServer['rules']>> }>('/api/v1/rules')).groups,
    stop: async () => {
      await proc.stop(3_000);
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
