/**
 * V8 garbage-collection pauses of a Sluice process, read off its Prometheus endpoint
 * (`nodejs_gc_duration_seconds`, prom-client's default metrics: the process's main thread only, not
 * the worker's engine thread). A pause stops everything that thread does, a token's hop included, so
 * their count and length say how much of a latency tail they can explain.
 */

/** Pauses so far, or between two readings. */
export interface GcPauses {
  count: number;
  totalMs: number;
  /** Pauses longer than 1 ms and 10 ms (the histogram's buckets). */
  over1Ms: number;
  over10Ms: number;
}

/** Reads the GC pauses of every kind from a Prometheus text endpoint. */
export async function readGcPauses(metricsUrl: string): Promise<GcPauses> {
  const text = await (await fetch(metricsUrl)).text();
  const pauses: GcPauses = { count: 0, totalMs: 0, over1Ms: 0, over10Ms: 0 };
  let within1Ms = 0;
  let within10Ms = 0;
  for (const line of text.split('\n')) {
    const match = /^nodejs_gc_duration_seconds_(bucket|sum|count)\{([^}]*)\} (\S+)$/.exec(line);
    if (match === null) continue;
    const [, series, labels, raw] = match;
    const value = Number(raw);
    if (series === 'count') pauses.count += value;
    else if (series === 'sum') pauses.totalMs += value * 1000;
    else if (/le="0\.001"/.test(labels!)) within1Ms += value;
    else if (/le="0\.01"/.test(labels!)) within10Ms += value;
  }
  pauses.over1Ms = pauses.count - within1Ms;
  pauses.over10Ms = pauses.count - within10Ms;
  return pauses;
}

/** What happened between two readings. */
export function gcPausesSince(before: GcPauses, after: GcPauses): GcPauses {
  return {
    count: after.count - before.count,
    totalMs: Math.round((after.totalMs - before.totalMs) * 100) / 100,
    over1Ms: after.over1Ms - before.over1Ms,
    over10Ms: after.over10Ms - before.over10Ms,
  };
}
