import type { Context } from 'hono';
import type { AppDeps } from '../app.js';

/** `GET /healthz`: the process is alive. */
export function healthHandler() {
  return (c: Context) => c.json({ status: 'ok' });
}

/** `GET /readyz`: Redis answers and at least one worker is live; 503 while draining. */
export function readyHandler(deps: AppDeps) {
  return async (c: Context) => {
    if (deps.drainPhase() !== 'serving') return c.json({ status: 'draining' }, 503);
    const redis = await deps.checkRedis();
    const workers = deps.registry.liveWorkerCount;
    const ready = redis && workers > 0;
    return c.json({ status: ready ? 'ready' : 'not_ready', redis, workers }, ready ? 200 : 503);
  };
}
