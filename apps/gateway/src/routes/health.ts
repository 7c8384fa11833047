import type { Context } from 'hono';
import type { AppDeps } from '../app.js';

/** What `/readyz` answers: ready when not draining, Redis answers and at least one worker is live. */
export interface Readiness {
  ready: boolean;
  status: 'ready' | 'not_ready' | 'draining';
  redis?: boolean;
  workers?: number;
}

/** The gateway's readiness, as `/readyz` and the `sluice_gateway_ready` gauge report it. */
export async function readiness(deps: Pick<AppDeps, 'drainPhase' | 'checkRedis' | 'registry'>): Promise<Readiness> {
  if (deps.drainPhase() !== 'serving') return { ready: false, status: 'draining' };
  const redis = await deps.checkRedis();
  const workers = deps.registry.liveWorkerCount;
  const ready = redis && workers > 0;
  return { ready, status: ready ? 'ready' : 'not_ready', redis, workers };
}

/** `GET /healthz`: the process is alive. */
export function healthHandler() {
  return (c: Context) => c.json({ status: 'ok' });
}

/** `GET /readyz`: Redis answers and at least one worker is live; 503 while draining. */
export function readyHandler(deps: AppDeps) {
  return async (c: Context) => {
    const { ready, ...body } = await readiness(deps);
    return c.json(body, ready ? 200 : 503);
  };
}
