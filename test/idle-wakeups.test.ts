import { readFileSync } from 'node:fs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * An idle gateway or worker is not woken for its metrics. Both used to measure their main thread's
 * event-loop delay with a 10 ms timer that never stopped (prom-client's default metrics, and the
 * worker's own monitor beside them): ~115 and ~100 wake-ups a second with no request in sight. The
 * delay is now measured while a request (gateway) or a job (worker) is open. Real processes, counted
 * from /proc: a main thread's voluntary context switches are its wake-ups.
 */

/** Voluntary context switches of a process's main thread so far. */
function mainThreadWakeups(pid: number): number {
  const status = readFileSync(`/proc/${pid}/task/${pid}/status`, 'utf8');
  return Number(/\nvoluntary_ctxt_switches:\s+(\d+)/.exec(status)?.[1]);
}

describe('idle processes', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let worker: WorkerProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    worker = await cluster.worker();
    gateway = await cluster.gateway();
  });

  afterAll(async () => {
    await cluster?.stop();
  });

  it('read their event-loop delay while they work, and report an idle window as 0', async () => {
    const res = await fetch(`${gateway.url}/v1/completions`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ model: MODEL, prompt: 'Once upon a time', max_tokens: 16, stream: true }),
    });
    expect(res.status).toBe(200);
    await res.text();
    const workerMetrics = worker.healthUrl.replace(/\/healthz$/, '/metrics');
    // The window since start holds the request: whole 10 ms periods at least.
    const busyGateway = await scrapePrometheus(`${gateway.url}/metrics`);
    const busyWorker = await scrapePrometheus(workerMetrics);
    expect(busyGateway.value('nodejs_eventloop_lag_p50_seconds')).toBeGreaterThanOrEqual(0.009);
    expect(busyWorker.value('nodejs_eventloop_lag_max_seconds')).toBeGreaterThanOrEqual(0.009);
    expect(busyWorker.value('sluice_worker_host_event_loop_lag_seconds', { quantile: '1' })).toBe(
      busyWorker.value('nodejs_eventloop_lag_max_seconds'),
    );
    // The worker ran no job since: an empty window.
    expect((await scrapePrometheus(workerMetrics)).value('nodejs_eventloop_lag_p99_seconds')).toBe(0);
  });

  it('are not woken a hundred times a second for their metrics', async () => {
    await sleep(500);
    const pids = { gateway: gateway.process.pid, worker: worker.process.pid };
    const before = { gateway: mainThreadWakeups(pids.gateway), worker: mainThreadWakeups(pids.worker) };
    const seconds = 3;
    await sleep(seconds * 1000);
    // What is left are their periodic duties (registry polls and heartbeats, sweeps, Redis replies):
    // ~20 a second for the gateway, ~3 for the worker on this project's machines.
    const perSecond = (name: keyof typeof pids) => (mainThreadWakeups(pids[name]) - before[name]) / seconds;
    expect(perSecond('gateway')).toBeLessThan(50);
    expect(perSecond('worker')).toBeLessThan(50);
  });
});
