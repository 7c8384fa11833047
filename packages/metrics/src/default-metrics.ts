import { collectDefaultMetrics, type Registry } from 'prom-client';

/**
 * Adds Node's default process metrics to `registry` unless it has them already, so that one registry
 * can be handed to both factories (prom-client throws on a second registration of a name).
 */
export function ensureDefaultMetrics(registry: Registry): void {
  if (registry.getSingleMetric('process_cpu_seconds_total') !== undefined) return;
  collectDefaultMetrics({ register: registry });
}
