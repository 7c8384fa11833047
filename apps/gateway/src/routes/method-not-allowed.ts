import type { Context } from 'hono';
import { GatewayError } from '../errors.js';

/**
 * The reply to a known route asked with a method it does not serve: 405 with `Allow` (RFC 9110), so
 * a client learns it reached the right path with the wrong verb rather than a missing route.
 */
export function methodNotAllowedHandler(methods: readonly string[]) {
  // A GET route answers HEAD too (Hono serves HEAD from GET handlers).
  const allow = (methods.includes('GET') ? [...methods, 'HEAD'] : [...methods]).join(', ');
  return (c: Context) => {
    throw new GatewayError('method_not_allowed', {
      message: `${c.req.method} is not allowed on ${c.req.path}; use ${allow}.`,
      headers: { Allow: allow },
    });
  };
}
