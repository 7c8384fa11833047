import { Counter, Gauge, Histogram } from 'prom-client';
import { vi, type MockInstance } from 'vitest';

/**
 * Records every prom-client write (counter/gauge/histogram updates and label lookups) made by metrics
 * created after this call; undo with `vi.restoreAllMocks()`. Counter#inc and Histogram#observe are
 * bound from `incWithoutExemplar` / `observeWithoutExemplar` when a metric is made, hence those names.
 */
export function spyOnPromClient(): string[] {
  const calls: string[] = [];
  const targets = [
    ['Counter', Counter.prototype, ['incWithoutExemplar', 'labels']],
    ['Gauge', Gauge.prototype, ['inc', 'dec', 'set', 'labels']],
    ['Histogram', Histogram.prototype, ['observeWithoutExemplar', 'labels']],
  ] as const;
  for (const [name, proto, methods] of targets) {
    for (const method of methods) {
      const original = (proto as unknown as Record<string, (...args: unknown[]) => unknown>)[method]!;
      (vi.spyOn as unknown as (object: object, name: string) => MockInstance)(proto, method).mockImplementation(function (
        this: unknown,
        ...args: unknown[]
      ) {
        calls.push(`${name}.${method}`);
        return original.apply(this, args);
      });
    }
  }
  return calls;
}
