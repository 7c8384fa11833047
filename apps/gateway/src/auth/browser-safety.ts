import { Hono, type Context, type MiddlewareHandler, type Next } from 'hono';
import { cors } from 'hono/cors';
import { secureHeaders } from 'hono/secure-headers';

type SecureHeadersOptions = NonNullable<Parameters<typeof secureHeaders>[0]>;
import type { AppEnv } from '../app.js';
import { GatewayError } from '../errors.js';

/** Headers a browser page may read from a cross-origin reply (the rate limits, the request and stream ids, its timing). */
const EXPOSED_HEADERS = [
  'x-request-id',
  'x-stream-id',
  'server-timing',
  'retry-after',
  'x-ratelimit-limit-requests',
  'x-ratelimit-remaining-requests',
  'x-ratelimit-reset-requests',
  'x-ratelimit-limit-tokens',
  'x-ratelimit-remaining-tokens',
  'x-ratelimit-reset-tokens',
];

/**
 * hono/secure-headers' defaults (nosniff, no referrer, same-origin resource and opener policies,
 * HSTS, ...) with framing denied. No Content-Security-Policy: JSON and SSE replies run nothing, and
 * the playground page at `/` is driven by tests through script evaluation that a CSP would block.
 */
const secureHeaderOptions: SecureHeadersOptions = { xFrameOptions: 'DENY' };

/**
 * The headers `middleware` puts on a plain `GET` reply to a request with no `Origin`, read once from
 * a throwaway app. Replies the responders write straight to the Node response pass no Hono
 * "after" step, and requests that are not a browser's skip hono/cors (below), so these lists are
 * set on the Node response before the handler runs.
 */
function probedHeaders(middleware: MiddlewareHandler): () => Promise<Array<[string, string]>> {
  let list: Promise<Array<[string, string]>> | undefined;
  return () =>
    (list ??= (async () => {
      const probe = new Hono().use(middleware).get('/', (c) => c.body(null));
      const res = await probe.request('/');
      return [...res.headers.entries()].filter(([name]) => name !== 'content-type');
    })());
}

function isJson(contentType: string): boolean {
  const type = contentType.split(';')[0]?.trim().toLowerCase() ?? '';
  return type === 'application/json' || (type.startsWith('application/') && type.endsWith('+json'));
}

/** Whether the request carries a body (declared length > 0, or chunked). */
function hasBody(headers: { 'content-length'?: string | undefined; 'transfer-encoding'?: string | undefined }): boolean {
  return (headers['content-length'] !== undefined && headers['content-length'] !== '0') || headers['transfer-encoding'] !== undefined;
}

/**
 * Browser safety, in the order it must run:
 * 1. CORS (hono/cors) with the CORS_ORIGINS allow-list, for every request that names an `Origin`
 *    and every preflight: preflights are answered (204); only listed origins get
 *    `Access-Control-Allow-Origin`; `*` only when CORS_ORIGINS says `*`. No credentials mode: keys
 *    travel in headers, never cookies. A request with no `Origin` (not a browser's: SDKs, curl,
 *    probes) gets the headers hono/cors gives such a request ({@link probedHeaders}) instead of
 *    passing it: hono/cors and secure-headers build a web `Response` and validated `Headers` per
 *    request (the gateway's CPU per request 17 % lower without them: `npm run bench:intake`,
 *    docs/benchmarks.md).
 * 2. Security headers (hono/secure-headers' list, read once) on every reply, errors and streams
 *    included, set on the Node response before the handler runs.
 * 3. A POST with a body must be `application/json` (415 otherwise): a page can send `text/plain` or a
 *    form cross-origin without a preflight, JSON it cannot.
 */
export function browserSafety(corsOrigins: readonly string[]): MiddlewareHandler<AppEnv>[] {
  const anyOrigin = corsOrigins.includes('*');
  const corsMiddleware = cors({
    origin: anyOrigin ? '*' : (origin) => (corsOrigins.includes(origin) ? origin : null),
    allowMethods: ['GET', 'POST', 'OPTIONS'],
    exposeHeaders: EXPOSED_HEADERS,
    maxAge: 600,
  });
  const securityHeaderList = probedHeaders(secureHeaders(secureHeaderOptions));
  const plainCorsHeaderList = probedHeaders(corsMiddleware);
  const safety = async (c: Context<AppEnv>, next: Next, browser: boolean): Promise<void> => {
    const out = c.env?.outgoing;
    if (out === undefined || !out.headersSent) {
      // Behind the Node server the headers go on its response (replies written past Hono included);
      // without it (app.request() in tests), on Hono's.
      const set =
        out === undefined
          ? (name: string, value: string) => c.header(name, value)
          : (name: string, value: string) => out.setHeader(name, value);
      for (const [name, value] of await securityHeaderList()) set(name, value);
      if (!browser) {
        for (const [name, value] of await plainCorsHeaderList()) set(name, value);
      } else if (out !== undefined) {
        // What hono/cors put on the pending response, for replies written past Hono.
        c.res.headers.forEach((value, name) => {
          if (name.startsWith('access-control-')) out.setHeader(name, value);
        });
      }
      // (Without the Node server, hono/cors or the plain list says `Vary: Origin` itself.)
      if (!anyOrigin && out !== undefined) out.setHeader('Vary', 'Origin');
    }
    if (c.req.method === 'POST') {
      const contentType = c.req.header('content-type');
      const incoming = c.env?.incoming;
      const bodied = incoming === undefined ? contentType !== undefined : hasBody(incoming.headers);
      if ((contentType !== undefined && !isJson(contentType)) || (contentType === undefined && bodied)) {
        throw new GatewayError('unsupported_media_type', {
          message: `The request body must be application/json (got ${contentType === undefined ? 'no Content-Type' : JSON.stringify(contentType.slice(0, 100))}).`,
        });
      }
    }
    await next();
  };
  const middleware: MiddlewareHandler<AppEnv> = async (c, next) => {
    if (c.req.method === 'OPTIONS' || c.req.header('origin') !== undefined) {
      return corsMiddleware(c, () => safety(c, next, true));
    }
    return safety(c, next, false);
  };
  return [middleware];
}
