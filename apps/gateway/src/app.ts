import { randomUUID } from 'node:crypto';
import { Hono } from 'hono';
import { REQUEST_ID_PATTERN } from '@sluice/protocol';
import type { HttpBindings } from '@hono/node-server';
import { RESPONSE_ALREADY_SENT } from '@hono/node-server/utils/response';
import type { Logger } from 'pino';
import type { AccessControl } from './auth/access-control.js';
import type { AuthenticatedKey } from './auth/auth-middleware.js';
import { browserSafety } from './auth/browser-safety.js';
import type { GatewayConfig } from './config.js';
import { errorHeaders, GatewayError, toErrorBody, toGatewayError } from './errors.js';
import type { GatewayHooks } from './hooks.js';
import type { JobSubmitter } from './job-queue.js';
import { generateHandler } from './routes/generate.js';
import { healthHandler, readyHandler } from './routes/health.js';
import { methodNotAllowedHandler } from './routes/method-not-allowed.js';
import { modelHandler, modelsHandler } from './routes/models.js';
import { versionHandler } from './routes/version.js';
import { docsHandlers, openApiHandler } from './routes/docs.js';
import { detokenizeHandler, tokenizeHandler } from './routes/tokenize.js';
import { playgroundHandlers } from './routes/playground.js';
import { cancelHandler, resumeHandler } from './routes/resume.js';
import type { SessionManager } from './session-manager.js';
import type { TokenLog } from './token-log-reader.js';
import type { HeartbeatTicker } from './sse-writer.js';
import type { TokenizerSource } from './tokenizer-cache.js';
import type { ModelCatalog } from './worker-registry.js';
import type { IdempotencyStore } from './idempotency-store.js';

/** Everything the HTTP app uses; `main.ts` wires the Redis-backed ones, tests and benchmarks fakes. */
export interface AppDeps {
  config: GatewayConfig;
  logger: Logger;
  /** This gateway's pub/sub channel, written into every job. */
  channel: string;
  sessions: SessionManager;
  jobs: JobSubmitter;
  /** Token logs and request metas: resume and cancel by id. */
  log: TokenLog;
  registry: ModelCatalog;
  /** The served models' tokenizers (from their workers' model cards): prompts are counted here. */
  tokenizers: TokenizerSource;
  heartbeats: HeartbeatTicker;
  checkRedis(): Promise<boolean>;
  drainPhase(): DrainPhase;
  hooks: GatewayHooks;
  /** `Idempotency-Key` records (idempotency-store.ts); absent: the header is checked but not acted on. */
  idempotency?: IdempotencyStore;
  /** API keys and per-key limits (auth/access-control.ts); absent: no key is checked. */
  access?: AccessControl;
}

/**
 * Where a stop stands: `serving`; `unready` (a SIGTERM came: `/readyz` answers 503, new requests are
 * still taken for `DRAIN_DELAY_MS`); `refusing` (new requests and resumes get 503 `shutting_down`
 * while the open streams finish).
 */
export type DrainPhase = 'serving' | 'unready' | 'refusing';

export type AppEnv = { Bindings: HttpBindings; Variables: { requestId: string; apiKey?: AuthenticatedKey } };

/** Route patterns for `sluice_gateway_requests_total{route}`; any other path counts as `other`. */
const ROUTES = new Set([
  '/healthz',
  '/readyz',
  '/metrics',
  '/v1/models',
  '/v1/chat/completions',
  '/v1/completions',
  '/health',
  '/version',
  '/tokenize',
  '/detokenize',
  '/openapi.json',
  '/docs',
  '/',
]);

/** The route pattern of a resume or cancel path (the id never becomes a label). */
function resumeRoute(path: string): string | undefined {
  if (path.startsWith('/v1/models/')) return '/v1/models/{id}';
  const match = /^\/v1\/(chat\/completions|completions)\/[^/]+(\/cancel)?$/.exec(path);
  return match === null ? undefined : `/v1/${match[1]}/{id}${match[2] ?? ''}`;
}

/** The client's (or nginx's) `X-Request-Id` when it is a sane id, else a fresh one. */
export function requestIdFrom(header: string | undefined): string {
  return header !== undefined && REQUEST_ID_PATTERN.test(header) ? header : randomUUID();
}

/** The gateway's HTTP API. No I/O happens here until a request arrives. */
export function createApp(deps: AppDeps) {
  const app = new Hono<AppEnv>();
  const { hooks } = deps;

  // Every reply carries `x-request-id`, and every response is counted by route and status once it
  // is over (streams included: their status is the one that went out, 499 if none did).
  app.use('*', async (c, next) => {
    const requestId = requestIdFrom(c.req.header('x-request-id'));
    c.set('requestId', requestId);
    const incoming = c.env?.incoming;
    const outgoing = c.env?.outgoing;
    if (incoming !== undefined && incoming.httpVersion === '1.1' && incoming.headers.host === undefined) {
      throw new GatewayError('bad_http_request', { message: 'An HTTP/1.1 request needs a Host header.' });
    }
    if (hooks.responded !== undefined && outgoing !== undefined) {
      const route = ROUTES.has(c.req.path) ? c.req.path : (resumeRoute(c.req.path) ?? 'other');
      const responded = hooks.responded;
      outgoing.once('close', () => responded(route, outgoing.headersSent ? outgoing.statusCode : 499));
    }
    await next();
    if (outgoing !== undefined && (outgoing.headersSent || outgoing.destroyed)) {
      // A responder wrote its reply on the Node response itself (streams, the JSON completion) and
      // returned RESPONSE_ALREADY_SENT. If a middleware had touched c.res before (hono/cors does),
      // Hono wrapped that marker into a new Response, which @hono/node-server would try to send
      // again (an ERR_HTTP_HEADERS_SENT stack logged per stream): hand it the marker itself.
      c.res = undefined;
      c.res = RESPONSE_ALREADY_SENT;
      return;
    }
    if (!c.res.headers.has('x-request-id')) {
      try {
        c.res.headers.set('X-Request-Id', requestId);
      } catch {
        // An immutable header list (a fetched Response): the reply goes out without the id.
      }
    }
  });

  app.onError((err, c) => {
    const error = toGatewayError(err);
    const requestId = c.get('requestId');
    if (error.code === 'internal') deps.logger.error({ err, requestId }, 'request failed');
    // A client that left mid-body gets no reply: there is no one to send it to.
    if (error.code === 'client_closed') c.env.outgoing.destroy();
    hooks.rejected?.(error.code);
    return c.json(toErrorBody(error), error.status as 400, {
      'X-Request-Id': requestId,
      ...errorHeaders(error, deps.config.retryAfterS),
    });
  });
  app.notFound((c) => {
    const error = new GatewayError('not_found', { message: `No route for ${c.req.method} ${c.req.path}.` });
    return c.json(toErrorBody(error), 404, { 'X-Request-Id': c.get('requestId') });
  });

  // CORS, security headers, JSON-only POSTs; then API keys on the API (health and metrics stay open).
  for (const middleware of browserSafety(deps.config.access.corsOrigins)) app.use('*', middleware);
  if (deps.access?.authenticate !== undefined) {
    app.use('/v1/*', deps.access.authenticate);
    // Tokenization runs a served model's tokenizer: as closed as the API.
    app.use('/tokenize', deps.access.authenticate);
    app.use('/detokenize', deps.access.authenticate);
  }

  app.get('/healthz', healthHandler());
  app.get('/health', healthHandler());
  app.get('/readyz', readyHandler(deps));
  app.get('/version', versionHandler());
  app.get('/v1/models', modelsHandler(deps));
  app.get('/v1/models/:id{.+}', modelHandler(deps));
  app.post('/tokenize', tokenizeHandler(deps));
  app.post('/detokenize', detokenizeHandler(deps));
  app.get('/openapi.json', openApiHandler());
  const docs = docsHandlers();
  app.get('/docs', docs.page);
  // (The trailing-slash form was a 404.)
  app.get('/docs/', (c) => c.redirect('/docs', 301));
  app.get('/docs/:file', docs.asset);
  // The playground: a chat page over the public API.
  const playground = playgroundHandlers();
  app.get('/', playground.page);
  app.get('/playground/:file', playground.file);
  // The body (size-limited by MAX_BODY_BYTES) is read in the handler, straight off the Node request.
  app.post('/v1/chat/completions', generateHandler(deps, 'chat'));
  app.post('/v1/completions', generateHandler(deps, 'completion'));
  // Durable streams: resume after a cursor, and cancel, by the chunks' id, from any gateway.
  app.get('/v1/chat/completions/:id', resumeHandler(deps, 'chat'));
  app.get('/v1/completions/:id', resumeHandler(deps, 'completion'));
  app.post('/v1/chat/completions/:id/cancel', cancelHandler(deps, 'chat'));
  app.post('/v1/completions/:id/cancel', cancelHandler(deps, 'completion'));
  // A known path asked with another method: 405 with `Allow`. Registered last, so only requests that
  // no route above answered reach it.
  const allowed: Record<string, string[]> = {
    '/healthz': ['GET'],
    '/health': ['GET'],
    '/readyz': ['GET'],
    '/version': ['GET'],
    '/v1/models': ['GET'],
    '/v1/models/:id{.+}': ['GET'],
    '/v1/chat/completions': ['POST'],
    '/v1/completions': ['POST'],
    '/v1/chat/completions/:id': ['GET'],
    '/v1/completions/:id': ['GET'],
    '/v1/chat/completions/:id/cancel': ['POST'],
    '/v1/completions/:id/cancel': ['POST'],
    '/tokenize': ['POST'],
    '/detokenize': ['POST'],
    '/openapi.json': ['GET'],
    '/docs': ['GET'],
    '/': ['GET'],
  };
  for (const [path, methods] of Object.entries(allowed)) app.all(path, methodNotAllowedHandler(methods));
  return app;
}
