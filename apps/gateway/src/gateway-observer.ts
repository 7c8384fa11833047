import type { Logger } from 'pino';
import type { GatewayMetrics } from '@sluice/metrics';
import { errorCodeTable } from './errors.js';
import { workGoesOn, type GatewayHooks, type RequestObserver } from './hooks.js';

/** The routes that take work: their statuses are the ones the 5xx-ratio alert reads (deploy/prometheus/alerts.yml). */
const COMPLETION_ROUTES = ['/v1/chat/completions', '/v1/completions'];

/**
 * The gateway's hooks, implemented with `@sluice/metrics` (served on `GET /metrics`) and pino: one
 * child logger per request carrying `requestId` (the id the client sees) and `jobId` (ours), and one
 * info line when the request ends, with its outcome, tokens and milliseconds, and the gateway's side of
 * the TTFT breakdown (`timing`: epoch ms of the receive, then ms after it; the worker's line of the
 * same `jobId` has its side, on the same clock: docs/benchmarks.md).
 */
export function createGatewayObserver(metrics: GatewayMetrics, logger: Logger): GatewayHooks {
  // Series that exist from the first scrape: rate() and increase() miss the increment that creates a
  // series, so a gateway's first refusal, stream error or 5xx would not count in a rate or an alert.
  for (const [code, { status }] of Object.entries(errorCodeTable)) {
    metrics.rejected.labels(code).inc(0);
    metrics.streamErrors.labels(code).inc(0);
    for (const route of COMPLETION_ROUTES) metrics.countRequest(route, status, 0);
  }
  for (const route of COMPLETION_ROUTES) metrics.countRequest(route, 200, 0);
  for (const stream of ['true', 'false']) metrics.requestReplays.labels(stream).inc(0);
  return {
    // The main thread's event-loop delay is measured while a request is open (an idle gateway is not woken for it).
    httpRequestOpened: () => metrics.eventLoopDelay.begin(),
    responded: (route, status) => metrics.countRequest(route, status),
    rejected: (code) => metrics.rejected.labels(code).inc(),
    // Bound once: the SSE writer calls this per write per client.
    sseWritten: metrics.sseWritten,
    streamGap: () => metrics.streamGaps.inc(),
    streamResumed: () => metrics.streamResumes.inc(),
    requestReplayed: (stream) => metrics.requestReplays.labels(String(stream)).inc(),
    resumedStreamOpened: () => {
      metrics.activeStreams.inc();
      metrics.activeResumedStreams.inc();
      let open = true;
      return () => {
        if (!open) return;
        open = false;
        metrics.activeStreams.dec();
        metrics.activeResumedStreams.dec();
      };
    },
    // Bound once: a resumed stream calls this per write.
    resumedTokensWritten: metrics.tokensWritten,
    streamMigrated: (byThisGateway) => {
      if (byThisGateway) metrics.streamMigrations.inc();
    },
    requestStarted({ requestId, jobId, endpoint, model, stream, receivedAt }): RequestObserver {
      const tracker = metrics.trackRequest({ stream, receivedAt });
      const log = logger.child({ requestId, jobId });
      let writtenTokens = 0;
      // Spans before the first token, on the performance.now() clock (ms); plain numbers, set once.
      const preparedAt = performance.now();
      let enqueuedAt = 0;
      let acceptedAt = 0;
      let scheduledAt = 0;
      let firstContentAt = 0;
      return {
        enqueued() {
          enqueuedAt = performance.now();
        },
        accepted() {
          acceptedAt = performance.now();
        },
        scheduled() {
          scheduledAt = performance.now();
          tracker.started();
        },
        contentWritten(tokens) {
          writtenTokens += tokens;
          if (firstContentAt === 0 && tokens > 0) firstContentAt = performance.now();
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
            case 'slow_client':
              tracker.slowClient(end.cause);
              break;
            case 'error':
              tracker.fail(end.code, end.detached === true);
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
              ...(end.outcome === 'slow_client' ? { cause: end.cause } : {}),
              ...(workGoesOn(end) ? { detached: true } : {}),
              status,
              promptTokens,
              completionTokens,
              writtenTokens,
              ms: Math.round(performance.now() - receivedAt),
              timing: {
                receivedAt: round3(performance.timeOrigin + receivedAt),
                preparedMs: round3(preparedAt - receivedAt),
                ...(enqueuedAt === 0 ? {} : { enqueuedMs: round3(enqueuedAt - receivedAt) }),
                ...(acceptedAt === 0 ? {} : { acceptedMs: round3(acceptedAt - receivedAt) }),
                ...(scheduledAt === 0 ? {} : { scheduledMs: round3(scheduledAt - receivedAt) }),
                ...(firstContentAt === 0 ? {} : { firstTokenMs: round3(firstContentAt - receivedAt) }),
              },
            },
            'request finished',
          );
        },
      };
    },
  };
}

/** Milliseconds to the microsecond: enough for spans, short in the log. */
function round3(ms: number): number {
  return Math.round(ms * 1000) / 1000;
}
