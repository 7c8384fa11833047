import type { AddressInfo } from 'node:net';
import { serve, type ServerType } from '@hono/node-server';
import { pino } from 'pino';
import { createGatewayMetrics, type GatewayMetrics } from '@sluice/metrics';
import type { CancelReason, GatewayEntryDraft, GenerateJob } from '@sluice/protocol';
import { createApp } from '../../src/app.js';
import { clientErrorHandler } from '../../src/client-error.js';
import type { AccessControl } from '../../src/auth/access-control.js';
import { loadGatewayConfig } from '../../src/config.js';
import { createGatewayObserver } from '../../src/gateway-observer.js';
import type { RequestSession } from '../../src/request-session.js';
import { SessionManager } from '../../src/session-manager.js';
import { HeartbeatTicker } from '../../src/sse-writer.js';
import type { TokenLog } from '../../src/token-log-reader.js';
import type { ModelTokenizer } from '../../src/tokenizer-cache.js';

type DistributiveOmit<T, K extends PropertyKey> = T extends unknown ? Omit<T, K> : never;

/**
 * The HTTP/SSE path in process: the real app, sessions, SSE writer and metrics, wired as main.ts
 * wires them; the worker is the test, which dispatches gateway-channel messages by hand.
 */
export interface AppHarness {
  url: string;
  jobs: GenerateJob[];
  cancels: Array<{ requestId: string; reason: CancelReason; wasQueued: boolean }>;
  metrics: GatewayMetrics;
  /** Dispatches entries for the latest job (or `job`), numbering them from `seq` on unless told otherwise. */
  send(entries: Array<Partial<{ seq: number }> & DistributiveOmit<GatewayEntryDraft, 'requestId'>>, job?: GenerateJob): void;
  nextJob(): Promise<GenerateJob>;
  /** A metric's value summed over the series whose labels match. */
  value(name: string, labels?: Record<string, string>): Promise<number>;
  close(): Promise<void>;
}

const open: AppHarness[] = [];

/** One token per character (code mod 256), a chat as its contents joined: enough to count prompts. */
const charTokenizer: ModelTokenizer = {
  maxContextLength: 100,
  vocabSize: 256,
  encodeChat: (messages) => [...messages.map((m) => m.content).join('\n')].map((ch) => ch.charCodeAt(0) % 256),
  encodeText: (prompt) => [...prompt].map((ch) => ch.charCodeAt(0) % 256),
  decode: (ids) => String.fromCharCode(...ids),
};

/** Closes every harness started so far (call from `afterEach`). */
export async function closeAppHarnesses(): Promise<void> {
  await Promise.all(open.splice(0).map((h) => h.close()));
}

/**
 * `access`: API keys and limits (auth/access-control.ts), as main.ts wires them; absent: none.
 * `tokenizer`: every model's tokenizer; absent: one token per character.
 */
export async function startAppHarness(
  env: Record<string, string> = {},
  options: { access?: AccessControl; tokenizer?: ModelTokenizer } = {},
): Promise<AppHarness> {
  const config = loadGatewayConfig({ HEADERS_WAIT_MS: '1000', ...env });
  const logger = pino({ level: 'silent' });
  const metrics = createGatewayMetrics();
  const hooks = createGatewayObserver(metrics, logger);
  const jobs: GenerateJob[] = [];
  const cancels: AppHarness['cancels'] = [];
  const jobWaiters: Array<(job: GenerateJob) => void> = [];
  const log: TokenLog = {
    read: async () => ({ entries: [], known: false }),
    meta: async () => undefined,
    last: async () => undefined,
    tail: async () => [],
  };
  const sessions = new SessionManager(
    { queueTimeoutMs: config.queueTimeoutMs, idleTimeoutMs: config.idleTimeoutMs },
    {
      cancel: (session: RequestSession, reason, wasQueued) => cancels.push({ requestId: session.requestId, reason, wasQueued }),
      detach: () => {},
      migrate: async () => ({ outcome: 'gone' as const }),
    },
    // No worker writes a log here: a gap finds nothing to repair with.
    log,
    logger,
    (gap) => hooks.streamGap?.(gap),
  );
  const heartbeats = new HeartbeatTicker(config.heartbeatMs, config.clientStallTimeoutMs);
  const app = createApp({
    config,
    logger,
    channel: 'test-channel',
    sessions,
    heartbeats,
    hooks,
    jobs: {
      submit: async (job) => {
        jobs.push(job);
        jobWaiters.shift()?.(job);
      },
      attach: async () => {},
      jobState: async (requestId) => ({ queued: jobs.some((job) => job.requestId === requestId), cancelled: false }),
      cancelRequest: async () => {},
    },
    log,
    registry: {
      liveWorkerCount: 1,
      models: () => [{ id: 'm', maxContextLength: 100, workers: 1 }],
      requireModel: (id) => ({ id, maxContextLength: 100, workers: 1, maxBatchSize: 16 }),
    },
    tokenizers: { forModel: async () => options.tokenizer ?? charTokenizer },
    checkRedis: async () => true,
    drainPhase: () => 'serving',
    ...(options.access === undefined ? {} : { access: options.access }),
  });
  app.get('/metrics', async (c) => c.body(await metrics.registry.metrics(), 200, { 'Content-Type': metrics.registry.contentType }));
  const server = await new Promise<ServerType>((resolve) => {
    const s = serve({ fetch: app.fetch, port: 0, hostname: '127.0.0.1', serverOptions: { requireHostHeader: false } }, () => resolve(s));
  });
  server.on('clientError', clientErrorHandler(logger, hooks));
  const seqs = new Map<string, number>();
  const harness: AppHarness = {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    jobs,
    cancels,
    metrics,
    send(entries, target) {
      const job = target ?? jobs.at(-1)!;
      const drafts = entries.map((e) => {
        const seq = e.seq ?? seqs.get(job.requestId) ?? 0;
        seqs.set(job.requestId, seq + 1);
        return { ...e, requestId: job.requestId, seq };
      });
      sessions.dispatch({ workerId: 'w1', entries: drafts });
    },
    nextJob: () => new Promise((resolve) => jobWaiters.push(resolve)),
    async value(name, labels = {}) {
      const metric = metrics.registry.getSingleMetric(name);
      if (metric === undefined) throw new Error(`no metric ${name}`);
      const { values } = await metric.get();
      return values
        .filter((v) => Object.entries(labels).every(([k, want]) => String((v.labels as Record<string, unknown>)[k]) === want))
        .reduce((sum, v) => sum + v.value, 0);
    },
    close: async () => {
      sessions.close();
      heartbeats.close();
      await new Promise<void>((resolve) => {
        server.close(() => resolve());
        if ('closeAllConnections' in server) server.closeAllConnections();
      });
    },
  };
  open.push(harness);
  return harness;
}
