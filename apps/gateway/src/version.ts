import { createHash } from 'node:crypto';
import { createRequire } from 'node:module';

/**
 * The gateway's version, from its package.json (one directory above both `src/` and `dist/`), read
 * once when first asked for.
 */
let version: string | undefined;
export function gatewayVersion(): string {
  version ??= (createRequire(import.meta.url)('../package.json') as { version: string }).version;
  return version;
}

/**
 * `system_fingerprint`: what the OpenAI API uses to say "the backend configuration changed, the same
 * seed may give other tokens". Here it names the gateway release and the model id.
 */
const fingerprints = new Map<string, string>();
export function systemFingerprint(model: string): string {
  let fingerprint = fingerprints.get(model);
  if (fingerprint === undefined) {
    fingerprint = `fp_${createHash('sha256').update(`sluice@${gatewayVersion()}:${model}`).digest('hex').slice(0, 10)}`;
    // Model ids come from live workers: few, but cap the map all the same.
    if (fingerprints.size < 1024) fingerprints.set(model, fingerprint);
  }
  return fingerprint;
}
