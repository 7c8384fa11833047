import type { Registry } from 'prom-client';
import { createGatewayMetrics, createWorkerMetrics } from '../../src/index.js';

export interface MetricInfo {
  name: string;
  process: 'gateway' | 'worker';
  type: 'counter' | 'gauge' | 'histogram' | 'summary';
  help: string;
  labelNames: string[];
  /** Bucket upper bounds, for histograms. */
  buckets?: number[];
}

/** Every metric the two factories register, default process metrics included. */
export function metricCatalog(): MetricInfo[] {
  return [...describeRegistry('gateway', createGatewayMetrics().registry), ...describeRegistry('worker', createWorkerMetrics().registry)];
}

function describeRegistry(process: MetricInfo['process'], registry: Registry): MetricInfo[] {
  return registry.getMetricsAsArray().map((metric) => {
    // prom-client keeps these on the metric object without typing them.
    const { labelNames = [], upperBounds } = metric as unknown as { labelNames?: string[]; upperBounds?: number[] };
    return {
      name: metric.name,
      process,
      type: String(metric.type) as MetricInfo['type'],
      help: metric.help,
      labelNames: [...labelNames],
      ...(upperBounds === undefined ? {} : { buckets: [...upperBounds] }),
    };
  });
}

/** The series names a metric appears under in the text format. */
export function seriesNames(metric: MetricInfo): string[] {
  if (metric.type === 'histogram') return ['_bucket', '_sum', '_count'].map((suffix) => metric.name + suffix);
  if (metric.type === 'summary') return [metric.name, `${metric.name}_sum`, `${metric.name}_count`];
  return [metric.name];
}
