import type { Logger } from 'pino';
import type { GatewayMetrics } from '@sluice/metrics';
import type { GatewayHooks, RequestObserver } from './hooks.js';

/**
 * The gateway's hooks, implemented with `@sluice/metrics` (served on `GET /metrics`) and pino: one
 * child logger per request carrying `requestId` (the id the client sees) and `jobId` (ours), and one
 * info line when the request ends, with its outcome, tokens and milliseconds.
 */
export function createGatewayObserver(metrics: GatewayMetrics, logger: Logger): GatewayHooks {
  return {
    responded: (route, status) => metrics.countRequest(route, status),
    rejected: (code) => metrics.rejected.labels(code).inc(),
    // Bound once: the SSE writer calls this per write per client.
    sseWritten: metrics.sseWritten,
    streamGap: () => metrics.streamGaps.inc(),
    streamResumed: () => metrics.streamResumes.inc(),
    requestStarted({ requestId, jobId, endpoint, model, stream, receivedAt }): RequestObserver {
      const tracker = metrics.trackRequest({ stream, receivedAt });
      const log = logger.child({ requestId, jobId });
      let writtenTokens = 0;
      return {
        accepted: () => tracker.started(),
        contentWritten(tokens) {
          writtenTokens += tokens;
          tracker.contentWritten(tokens);
        },
        tokensWithoutText(tokens) {
          writtenTokens += tokens;
          tracker.tokensWithoutText(tokens);
        },
        finished({ end, status, promptTokens, completionTokens }) {
          if (tracker.ended) return;
          const stage = tracker.stage;
          switch (end.outcome) {
            case 'stop':
            case 'length':
            case 'cancelled':
              tracker.finish(end.outcome);
              break;
            case 'disconnect':
              tracker.disconnect(end.detached === true);
              break;
            case 'timeout':
              tracker.timeout(end.kind);
              break;
            case 'error':
              tracker.fail(end.code);
              break;
          }
          log.info(
            {
              endpoint,
              model,
              stream,
              outcome: end.outcome,
              ...('code' in end ? { code: end.code } : {}),
              ...(end.outcome === 'disconnect' ? { stage } : {}),
              status,
              promptTokens,
              completionTokens,
              writtenTokens,
              ms: Math.round(performance.now() - receivedAt),
            },
            'request finished',
          );
        },
      };
    },
  };
}
