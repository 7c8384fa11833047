import { collectDefaultMetrics, Gauge, type Registry } from 'prom-client';
import { EventLoopDelay, type EventLoopDelayWindow } from './event-loop-delay.js';

/** Node's default process metrics in a registry, with the main thread's event-loop delay measured only under work. */
export interface DefaultMetrics {
  /** Call `begin()` for each piece of work (a request, a job): the delay is measured while any is open. */
  readonly eventLoopDelay: EventLoopDelay;
  /**
   * Takes the event-loop delay's window since the previous call into the `nodejs_eventloop_lag_*`
   * gauges (all 0 for a window without work) and returns it: once per scrape, before the registry is read.
   */
  takeEventLoopDelay(): EventLoopDelayWindow;
}

/** prom-client's event-loop delay gauges, fed here from {@link EventLoopDelay} instead of its always-on monitor. */
const LAG_GAUGES: ReadonlyArray<readonly [keyof EventLoopDelayWindow, string, string]> = [
  ['min', 'nodejs_eventloop_lag_min_seconds', 'The minimum recorded event loop delay.'],
  ['max', 'nodejs_eventloop_lag_max_seconds', 'The maximum recorded event loop delay.'],
  ['mean', 'nodejs_eventloop_lag_mean_seconds', 'The mean of the recorded event loop delays.'],
  ['stddev', 'nodejs_eventloop_lag_stddev_seconds', 'The standard deviation of the recorded event loop delays.'],
  ['p50', 'nodejs_eventloop_lag_p50_seconds', 'The 50th percentile of the recorded event loop delays.'],
  ['p90', 'nodejs_eventloop_lag_p90_seconds', 'The 90th percentile of the recorded event loop delays.'],
  ['p99', 'nodejs_eventloop_lag_p99_seconds', 'The 99th percentile of the recorded event loop delays.'],
];

/**
 * prom-client's own monitor cannot be turned off: its period is set to the longest a timer takes
 * (2^31 − 1 ms, ~25 days) so that it stays asleep, and its gauges are replaced.
 */
const DORMANT_PRECISION_MS = 2 ** 31 - 1;

const byRegistry = new WeakMap<Registry, DefaultMetrics>();

/** One of prom-client's default metrics: present when someone called `collectDefaultMetrics` on the registry already. */
const DEFAULT_METRIC_PROBE = 'process_cpu_user_seconds_total';

/**
 * Adds Node's default process metrics to `registry` unless it has them already, so that one registry
 * can be handed to both factories, or one the caller filled with `collectDefaultMetrics` itself
 * (prom-client throws on a second registration of a name; such a caller's monitor keeps running). The
 * `nodejs_eventloop_lag_{min,max,mean,stddev,p50,p90,p99}_seconds` gauges keep prom-client's names and
 * meaning (whole timer periods of 10 ms) but read an {@link EventLoopDelay}, which measures only while
 * the process has work: an idle gateway or worker is no longer woken 100 times a second.
 */
export function ensureDefaultMetrics(registry: Registry): DefaultMetrics {
  const known = byRegistry.get(registry);
  if (known !== undefined) return known;
  if (registry.getSingleMetric(DEFAULT_METRIC_PROBE) === undefined) {
    collectDefaultMetrics({ register: registry, eventLoopMonitoringPrecision: DORMANT_PRECISION_MS });
  }
  const gauges = LAG_GAUGES.map(([field, name, help]) => {
    registry.removeSingleMetric(name);
    return [field, new Gauge({ name, help, registers: [registry] })] as const;
  });
  const eventLoopDelay = new EventLoopDelay();
  const metrics: DefaultMetrics = {
    eventLoopDelay,
    takeEventLoopDelay() {
      const window = eventLoopDelay.take();
      for (const [field, gauge] of gauges) gauge.set(window[field]);
      return window;
    },
  };
  byRegistry.set(registry, metrics);
  return metrics;
}
