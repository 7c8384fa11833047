/**
 * The real Sluice processes for end-to-end tests, started from the BUILT apps
 * (`node apps/gateway/dist/main.js`, `node apps/worker/dist/main.js`): run the build first.
 */
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { freePort, startProcess, waitFor, type ManagedProcess } from './processes.js';

const root = fileURLToPath(new URL('../..', import.meta.url));
export const GATEWAY_MAIN = `${root}apps/gateway/dist/main.js`;
export const WORKER_MAIN = `${root}apps/worker/dist/main.js`;
const FAKE_WORKER = `${root}test/support/fake-worker.ts`;

function requireBuilt(path: string): void {
  if (!existsSync(path)) throw new Error(`${path} is missing: run \`npx turbo run build\` (or \`npm test\`) first`);
}

export interface GatewayProcess {
  readonly url: string;
  readonly process: ManagedProcess;
  /** GET a path, JSON body and status. */
  get(path: string): Promise<{ status: number; body: unknown }>;
}

export interface WorkerHealth {
  status: string;
  workerId: string;
  modelId: string;
  running: number;
  waiting: number;
  processed: number;
  skipped: number;
  steps: number;
  /** The latest cancelled sequence: ms between the cancel reaching the worker and the sequence leaving the batch. */
  lastCancel: { requestId: string; ms: number } | null;
}

export interface WorkerProcess {
  readonly healthUrl: string;
  readonly process: ManagedProcess;
  health(): Promise<WorkerHealth>;
  /** Waits until the worker runs nothing and its latest cancelled sequence is `requestId`'s. */
  sequenceCancelled(requestId: string | null): Promise<void>;
}

/**
 * Starts a gateway and waits until it answers `/healthz` (and `/readyz`, unless told not to).
 * `tree`: another checkout's root (ending in `/`, built) whose gateway to run (benchmarks' A/B).
 */
export async function startGateway(
  redisUrl: string,
  env: Record<string, string> = {},
  options: { waitReady?: boolean; tree?: string } = {},
): Promise<GatewayProcess> {
  const main = options.tree === undefined ? GATEWAY_MAIN : `${options.tree}apps/gateway/dist/main.js`;
  requireBuilt(main);
  const port = await freePort();
  const proc = startProcess('gateway', process.execPath, [main], {
    REDIS_URL: redisUrl,
    PORT: String(port),
    HOST: '127.0.0.1',
    LOG_LEVEL: 'warn',
    REGISTRY_POLL_MS: '200',
    ...env,
  });
  const url = `http://127.0.0.1:${port}`;
  const get = async (path: string) => {
    const res = await fetch(`${url}${path}`);
    return { status: res.status, body: await res.json() };
  };
  await waitFor(`gateway on ${url}\n${proc.output()}`, async () => ((await get('/healthz')).status === 200 ? true : undefined), 20_000);
  if (options.waitReady !== false) {
    await waitFor(`gateway ready (a live worker)`, async () => ((await get('/readyz')).status === 200 ? true : undefined), 30_000);
  }
  return { url, process: proc, get };
}

/**
 * Starts a worker (real engine, built-in tiny model unless MODEL_DIR says otherwise) and waits for its
 * `/healthz`. `tree`: another checkout's root (ending in `/`, built) whose worker to run.
 */
export async function startWorker(
  redisUrl: string,
  env: Record<string, string> = {},
  options: { fake?: boolean; tree?: string } = {},
): Promise<WorkerProcess> {
  const port = await freePort();
  const main = options.tree === undefined ? WORKER_MAIN : `${options.tree}apps/worker/dist/main.js`;
  const args = options.fake === true ? ['--import', 'tsx', FAKE_WORKER] : [main];
  requireBuilt(options.fake === true ? `${root}apps/worker/dist/worker.js` : main);
  const proc = startProcess('worker', process.execPath, args, {
    REDIS_URL: redisUrl,
    METRICS_PORT: String(port),
    METRICS_HOST: '127.0.0.1',
    // sequenceCancelled() reads the latest cancelled request's id off /healthz.
    HEALTH_REQUEST_IDS: 'true',
    LOG_LEVEL: 'warn',
    ...env,
  });
  const healthUrl = `http://127.0.0.1:${port}/healthz`;
  const health = async () => (await (await fetch(healthUrl)).json()) as WorkerHealth;
  await waitFor(
    `worker health on ${healthUrl}`,
    async () => {
      if (proc.child.exitCode !== null) throw new Error(`worker exited:\n${proc.output()}`);
      return (await health()).status === 'ok' ? true : undefined;
    },
    120_000,
    100,
  );
  const sequenceCancelled = async (requestId: string | null) => {
    await waitFor(
      `the sequence of ${requestId} cancelled`,
      async () => {
        const now = await health();
        return now.running === 0 && now.lastCancel?.requestId === requestId ? true : undefined;
      },
      10_000,
    );
  };
  return { healthUrl, process: proc, health, sequenceCancelled };
}
