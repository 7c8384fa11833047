/**
 * V8 garbage-collection pauses of a Sluice process, read off its Prometheus endpoint
 * (`nodejs_gc_duration_seconds`, prom-client's default metrics: the process's main thread only, not
 * the worker's engine thread). A pause stops everything that thread does, a token's hop included, so
 * their count and length say how much of a latency tail they can explain.
 */
import { scrapePrometheus } from '../../test/support/prometheus.js';

/** Pauses so far, or between two readings. */
export interface GcPauses {
  count: number;
  totalMs: number;
  /** Pauses longer than 1 ms and 10 ms (the histogram's buckets). */
  over1Ms: number;
  over10Ms: number;
}

/** The pauses of the gateway's and the worker's main threads. */
export interface StackGcPauses {
  gateway: GcPauses;
  worker: GcPauses;
}

/** Reads the GC pauses of every kind from a `/metrics` endpoint. */
export async function readGcPauses(metricsUrl: string): Promise<GcPauses> {
  const gc = (await scrapePrometheus(metricsUrl)).histogram('nodejs_gc_duration_seconds');
  const within = (le: number) => gc.buckets.find((bucket) => bucket.le === le)?.count ?? 0;
  return { count: gc.count, totalMs: gc.sum * 1000, over1Ms: gc.count - within(0.001), over10Ms: gc.count - within(0.01) };
}

/** What happened between two readings of both processes. */
export function gcPausesSince(before: StackGcPauses, after: StackGcPauses): StackGcPauses {
  const since = (a: GcPauses, b: GcPauses): GcPauses => ({
    count: b.count - a.count,
    totalMs: Math.round((b.totalMs - a.totalMs) * 100) / 100,
    over1Ms: b.over1Ms - a.over1Ms,
    over10Ms: b.over10Ms - a.over10Ms,
  });
  return { gateway: since(before.gateway, after.gateway), worker: since(before.worker, after.worker) };
}
