import { Counter, type Registry } from 'prom-client';

/**
 * Why a request with a valid key was refused: `requests`, `tokens`, `streams` (the 429 of that limit),
 * `tokens_over_limit` (the 400 of a request larger than the key's whole TPM: no retry could pass it),
 * `model` (403).
 */
export type KeyRefusal = 'requests' | 'tokens' | 'streams' | 'tokens_over_limit' | 'model';
/** Why a request was refused before any key was known (no `key` label: unknown keys make no series). */
export type AuthFailure = 'missing' | 'invalid';

/**
 * Usage per API key, labelled with the key's NAME (never the key). Names come only from issued keys,
 * and at most `maxKeys` of them get their own series; the rest are summed under `key="other"`, so a
 * deployment with thousands of keys cannot blow up the series count.
 */
export interface KeyUsageMetrics {
  readonly requests: Counter<'key'>;
  readonly tokens: Counter<'key' | 'kind'>;
  readonly refusals: Counter<'key' | 'reason'>;
  readonly authFailures: Counter<'reason'>;
  /** The `key` label for a key name: the name itself, or `other` once `maxKeys` names are in use. */
  label(name: string): string;
  /** An admitted request of key `name`. */
  admitted(name: string): void;
  /** A finished request's settled usage. */
  used(name: string, promptTokens: number, completionTokens: number): void;
  refused(name: string, reason: KeyRefusal): void;
  authFailed(reason: AuthFailure): void;
}

export function createKeyUsageMetrics(registry: Registry, maxKeys = 100): KeyUsageMetrics {
  const registers = [registry];
  const requests = new Counter({
    name: 'sluice_gateway_key_requests_total',
    help: 'Completion requests admitted per API key (key = the key name; at most METRICS_MAX_KEYS names, the rest as other).',
    labelNames: ['key'] as const,
    registers,
  });
  const tokens = new Counter({
    name: 'sluice_gateway_key_tokens_total',
    help: 'Tokens used per API key as settled when each request ended, by kind (prompt, completion).',
    labelNames: ['key', 'kind'] as const,
    registers,
  });
  const refusals = new Counter({
    name: 'sluice_gateway_key_refusals_total',
    help: 'Requests with a valid API key refused, by key and reason (requests, tokens, streams: the 429 limit hit; tokens_over_limit: 400, larger than the whole TPM; model: 403).',
    labelNames: ['key', 'reason'] as const,
    registers,
  });
  const authFailures = new Counter({
    name: 'sluice_gateway_auth_failures_total',
    help: 'Requests refused with 401, by reason (missing: no key sent; invalid: a key that was not issued or was revoked).',
    labelNames: ['reason'] as const,
    registers,
  });
  const named = new Set<string>();
  const label = (name: string): string => {
    if (named.has(name)) return name;
    if (named.size >= maxKeys) return 'other';
    named.add(name);
    return name;
  };
  return {
    requests,
    tokens,
    refusals,
    authFailures,
    label,
    admitted: (name) => requests.labels(label(name)).inc(),
    used(name, promptTokens, completionTokens) {
      const key = label(name);
      if (promptTokens > 0) tokens.labels(key, 'prompt').inc(promptTokens);
      if (completionTokens > 0) tokens.labels(key, 'completion').inc(completionTokens);
    },
    refused: (name, reason) => refusals.labels(label(name), reason).inc(),
    authFailed: (reason) => authFailures.labels(reason).inc(),
  };
}
