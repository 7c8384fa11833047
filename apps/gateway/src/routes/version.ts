import type { Context } from 'hono';
import { gatewayVersion } from '../version.js';

/** `GET /version`: the gateway's release, as vLLM's `/version` answers. */
export function versionHandler() {
  return (c: Context) => c.json({ version: gatewayVersion() });
}
