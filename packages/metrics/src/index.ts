export * from './buckets.js';
export { EventLoopDelay, type EventLoopDelayWindow } from './event-loop-delay.js';
export {
  createGatewayMetrics,
  type GatewayMetrics,
  type GatewayMetricsOptions,
  type SseEventKind,
  type TrackRequestOptions,
} from './gateway-metrics.js';
export { createKeyUsageMetrics, type AuthFailure, type KeyRefusal, type KeyUsageMetrics } from './key-usage-metrics.js';
export { ScrapeWatch } from './scrape-watch.js';
export { PendingHistogram } from './pending-histogram.js';
export {
  RequestTracker,
  type RequestInstruments,
  type RequestOutcome,
  type RequestStage,
  type SlowClientCause,
  type TimeoutKind,
} from './request-tracker.js';
export {
  QUEUE_JOB_STATES,
  createWorkerMetrics,
  type EngineStepStats,
  type FinishReason,
  type FinishedRequestStats,
  type QueueDepth,
  type QueueJobState,
  type StepPhase,
  type WorkerMetrics,
} from './worker-metrics.js';
export { Registry } from 'prom-client';
