import { afterAll, beforeAll } from 'vitest';
import { Cluster, MODEL } from '../support/cluster.js';
import type { GatewayProcess, WorkerProcess } from '../support/sluice.js';
import { empty, read, type Collected } from '../support/sse.js';

/**
 * What the stress loops share: streamed greedy requests (the same prompt gives the same answer on any
 * worker, in any batch), a resume, and the check that a delivery is the whole answer.
 */

/** Rounds of each loop (`STRESS_ROUNDS`, default 20). */
export const ROUNDS = Number(process.env.STRESS_ROUNDS ?? 20);

export const chatBody = (content: string, maxTokens: number, extra: Record<string, unknown> = {}) => ({
  model: MODEL,
  messages: [{ role: 'user', content }],
  max_tokens: maxTokens,
  temperature: 0,
  stream: true,
  ignore_eos: true,
  resume_grace_ms: 60_000,
  ...extra,
});

/** A streamed POST, and a way to leave it as a client whose network dropped. */
export function post(gateway: GatewayProcess, body: unknown, headers: Record<string, string> = {}) {
  const controller = new AbortController();
  const reply = fetch(`${gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify(body),
    signal: AbortSignal.any([controller.signal, AbortSignal.timeout(120_000)]),
  });
  return { reply, leave: () => controller.abort() };
}

export function resume(gateway: GatewayProcess, id: string, cursor?: string): Promise<Response> {
  return fetch(`${gateway.url}/v1/chat/completions/${id}?stream=true`, {
    headers: cursor === undefined ? {} : { 'last-event-id': cursor },
    signal: AbortSignal.timeout(120_000),
  });
}

/** Stops a {@link readReply} once `k` chunks carried text (and a cursor came). */
export const afterTextChunks =
  (k: number) =>
  (c: Collected): boolean =>
    c.textChunks >= k && c.lastEventId !== undefined;

/** Reads a reply to its end, or until `until` says so; a refused or cut reply is in `errors`. */
export async function readReply(res: Response | Promise<Response>, until?: (c: Collected) => boolean): Promise<Collected> {
  const out = empty();
  try {
    const reply = await res;
    if (reply.status !== 200) {
      out.errors.push(`${reply.status} ${await reply.text()}`);
      return out;
    }
    await read(reply, out, until);
  } catch (error) {
    out.errors.push(String(error));
  }
  return out;
}

/** Why a delivery is not the whole answer `expected` (undefined when it is). */
export function notWhole(got: Collected, expected: string): string | undefined {
  if (got.text === expected && got.done && got.errors.length === 0) return undefined;
  return JSON.stringify({
    text: got.text.length,
    expected: expected.length,
    done: got.done,
    errors: got.errors,
    finish: got.finishReasons,
  });
}

/**
 * An observer for the readers of `count` streams (as `readReply`'s `until`, stopping none): `reached`
 * resolves once each has had `k` text chunks (or after 20 s).
 */
export function whenAllReach(count: number, k: number): { reached: Promise<void>; until: (c: Collected) => boolean } {
  let left = count;
  let resolve!: () => void;
  const reached = new Promise<void>((r) => (resolve = r));
  return {
    reached: Promise.race([reached, new Promise<void>((r) => setTimeout(r, 20_000))]),
    until: (c) => {
      if (c.textChunks === k && --left === 0) resolve();
      return false;
    },
  };
}

/** Workers and gateways that notice a lost worker within about two seconds (as test/worker-migration.test.ts). */
export const MIGRATING_WORKER_ENV = { WORKER_HEARTBEAT_MS: '250', WORKER_TTL_MS: '1500', LOCK_DURATION_MS: '30000' };
export const MIGRATING_GATEWAY_ENV = { REGISTRY_POLL_MS: '200', IDLE_TIMEOUT_MS: '120000', HEADERS_WAIT_MS: '200' };

/** What {@link oneWorkerTwoGateways} starts; set once its `beforeAll` ran. */
export interface OneWorkerTwoGateways {
  cluster: Cluster;
  worker: WorkerProcess;
  gateways: GatewayProcess[];
  /** Runs `body` with the worker frozen (SIGSTOP) when `frozen`, and thaws it after. */
  withWorkerFrozen: <T>(frozen: boolean, body: () => Promise<T>) => Promise<T>;
}

/**
 * Inside a `describe`: redis-server, one worker (tiny model, a long registry TTL: it is frozen with
 * SIGSTOP) and two gateways with `gatewayEnv`, started before its tests and stopped after them.
 */
export function oneWorkerTwoGateways(gatewayEnv: Record<string, string>): OneWorkerTwoGateways {
  const stack = {
    gateways: [] as GatewayProcess[],
    withWorkerFrozen: async <T>(frozen: boolean, body: () => Promise<T>): Promise<T> => {
      if (frozen) stack.worker.process.signal('SIGSTOP');
      try {
        return await body();
      } finally {
        if (frozen) stack.worker.process.signal('SIGCONT');
      }
    },
  } as OneWorkerTwoGateways;
  beforeAll(async () => {
    stack.cluster = await Cluster.start();
    stack.worker = await stack.cluster.worker({ WORKER_TTL_MS: '30000' });
    stack.gateways.push(...(await Promise.all([stack.cluster.gateway(gatewayEnv), stack.cluster.gateway(gatewayEnv)])));
  });
  afterAll(async () => {
    stack.worker?.process.signal('SIGCONT');
    await stack.cluster?.stop();
  });
  return stack;
}

/**
 * Inside a `describe`: redis-server, two workers with `workerEnv` and two gateways that notice a lost
 * worker within about two seconds; a test replaces the workers and gateways it kills in these lists.
 */
export function twoWorkersTwoGateways(workerEnv: Record<string, string>): {
  cluster: Cluster;
  workers: WorkerProcess[];
  gateways: GatewayProcess[];
} {
  const stack = { workers: [] as WorkerProcess[], gateways: [] as GatewayProcess[] } as {
    cluster: Cluster;
    workers: WorkerProcess[];
    gateways: GatewayProcess[];
  };
  beforeAll(async () => {
    stack.cluster = await Cluster.start();
    stack.workers.push(await stack.cluster.worker(workerEnv), await stack.cluster.worker(workerEnv));
    stack.gateways.push(await stack.cluster.gateway(MIGRATING_GATEWAY_ENV), await stack.cluster.gateway(MIGRATING_GATEWAY_ENV));
  });
  afterAll(async () => {
    for (const worker of stack.workers) worker.process.signal('SIGCONT');
    await stack.cluster?.stop();
  });
  return stack;
}
