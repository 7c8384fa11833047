import { Hono } from 'hono';
import type { HttpBindings } from '@hono/node-server';
import type { Logger } from 'pino';
import type { GatewayConfig } from './config.js';
import { errorHeaders, GatewayError, toErrorBody, toGatewayError } from './errors.js';
import type { GatewayHooks } from './hooks.js';
import type { JobSubmitter } from './job-queue.js';
import { generateHandler } from './routes/generate.js';
import { healthHandler, readyHandler } from './routes/health.js';
import { modelsHandler } from './routes/models.js';
import type { SessionManager } from './session-manager.js';
import type { HeartbeatTicker } from './sse-writer.js';
import type { ModelCatalog } from './worker-registry.js';

/** Everything the HTTP app uses; `main.ts` wires the Redis-backed ones, tests and benchmarks fakes. */
export interface AppDeps {
  config: GatewayConfig;
  logger: Logger;
  /** This gateway's pub/sub channel, written into every job. */
  channel: string;
  sessions: SessionManager;
  jobs: JobSubmitter;
  registry: ModelCatalog;
  heartbeats: HeartbeatTicker;
  checkRedis(): Promise<boolean>;
  isDraining(): boolean;
  hooks: GatewayHooks;
}

/** The gateway's HTTP API. No I/O happens here until a request arrives. */
export function createApp(deps: AppDeps) {
  const app = new Hono<{ Bindings: HttpBindings }>();

  app.onError((err, c) => {
    const error = toGatewayError(err);
    if (error.code === 'internal') deps.logger.error({ err }, 'request failed');
    return c.json(toErrorBody(error), error.status as 400, errorHeaders(error, deps.config.retryAfterS));
  });
  app.notFound((c) => {
    const error = new GatewayError('not_found', { message: `No route for ${c.req.method} ${c.req.path}.` });
    return c.json(toErrorBody(error), 404);
  });

  app.get('/healthz', healthHandler());
  app.get('/readyz', readyHandler(deps));
  app.get('/v1/models', modelsHandler(deps));
  // The body (size-limited by MAX_BODY_BYTES) is read in the handler, straight off the Node request.
  app.post('/v1/chat/completions', generateHandler(deps, 'chat'));
  app.post('/v1/completions', generateHandler(deps, 'completion'));
  return app;
}
