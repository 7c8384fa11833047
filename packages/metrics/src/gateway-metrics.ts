import { ScrapeWatch, scrapeRegistry } from './scrape-watch.js';
import { Counter, Gauge, Histogram, Registry } from 'prom-client';
import { E2E_REQUEST_LATENCY_BUCKETS, INTER_TOKEN_LATENCY_BUCKETS, QUEUE_TIME_BUCKETS, TIME_TO_FIRST_TOKEN_BUCKETS } from './buckets.js';
import { ensureDefaultMetrics } from './default-metrics.js';
import type { EventLoopDelay } from './event-loop-delay.js';
import { createKeyUsageMetrics, type KeyUsageMetrics } from './key-usage-metrics.js';
import { PendingHistogram } from './pending-histogram.js';
import {
  RequestTracker,
  type RequestInstruments,
  type RequestOutcome,
  type RequestStage,
  type SlowClientCause,
  type TimeoutKind,
} from './request-tracker.js';

/** Kinds of SSE frames, counted apart so heartbeats do not hide in the content traffic. */
export type SseEventKind = 'chunk' | 'heartbeat' | 'error' | 'done';

const SSE_EVENT_KINDS: readonly SseEventKind[] = ['chunk', 'heartbeat', 'error', 'done'];
const REQUEST_STAGES: readonly RequestStage[] = ['queued', 'prefill', 'decode'];
const REQUEST_OUTCOMES: readonly RequestOutcome[] = [
  'stop',
  'length',
  'cancelled',
  'detached',
  'disconnect',
  'timeout',
  'slow_client',
  'error',
];
const TIMEOUT_KINDS: readonly TimeoutKind[] = ['queue', 'idle', 'deadline'];
const SLOW_CLIENT_CAUSES: readonly SlowClientCause[] = ['buffer', 'stall'];

export interface GatewayMetricsOptions {
  /** Monotonic clock in milliseconds, for tests. @defaultValue performance.now */
  now?: () => number;
  /** Key names with their own series in the per-key metrics (the rest: `other`). @defaultValue 100 */
  maxKeys?: number;
}

export interface TrackRequestOptions {
  /** Whether the client asked for an SSE stream. Only streams count as active streams and get TTFT/ITL. */
  stream: boolean;
  /**
   * When the request reached the gateway, on the `now` clock. Take it before reading and validating the
   * body, so that TTFT and end-to-end latency include them. @defaultValue now()
   */
  receivedAt?: number;
}

/** Metrics of one gateway process. Create one per process and serve `registry` on `GET /metrics`. */
export interface GatewayMetrics {
  readonly registry: Registry;
  /** The registry read for `GET /metrics`; the scrape is noted (see {@link ScrapeWatch}). */
  scrape(): Promise<string>;
  /** Resolves at the next scrape of a process scraped at a steady pace, within `maxMs` (ScrapeWatch.nextScrape). */
  nextScrape(maxMs: number): Promise<void>;
  /**
   * The main thread's event-loop delay (`nodejs_eventloop_lag_*`): `begin()` for each HTTP request the
   * server takes, its end when the response closes; measured only while one is open.
   */
  readonly eventLoopDelay: EventLoopDelay;
  readonly requests: Counter<'route' | 'status'>;
  readonly requestsAccepted: Counter;
  readonly activeStreams: Gauge;
  /** Resumed streams open now: counted in `activeStreams` too. */
  readonly activeResumedStreams: Gauge;
  readonly timeToFirstToken: Histogram;
  readonly interTokenLatency: Histogram;
  readonly e2eRequestLatency: Histogram;
  readonly requestQueueTime: Histogram;
  readonly requestOutcomes: Counter<'outcome'>;
  readonly disconnects: Counter<'stage'>;
  readonly timeouts: Counter<'kind'>;
  readonly slowClients: Counter<'cause'>;
  readonly streamErrors: Counter<'code'>;
  readonly streamGaps: Counter;
  readonly streamResumes: Counter;
  /** POSTs answered with the request their `Idempotency-Key` already named (a proxy's or client's retry). */
  readonly requestReplays: Counter<'stream'>;
  readonly streamMigrations: Counter;
  readonly streamTokens: Counter;
  readonly sseEvents: Counter<'kind'>;
  readonly sseBytes: Counter<'kind'>;
  readonly rejected: Counter<'reason'>;
  /** Usage per API key name (key-usage-metrics.ts). */
  readonly keyUsage: KeyUsageMetrics;
  /**
   * Counts one HTTP response. `route` is the route pattern (`/v1/chat/completions`), never the raw
   * path, so that the label stays low-cardinality. `by` 0 creates the series at zero (it then exists
   * from the first scrape: rate() misses a series' first increment).
   */
  countRequest(route: string, status: number, by?: number): void;
  /**
   * Reads `probe` at each scrape into `sluice_gateway_ready` (1: `/readyz` would answer 200): set once
   * the gateway runs; 0 until then, and when the probe fails or takes over a second.
   */
  observeReadiness(probe: () => Promise<boolean>): void;
  /**
   * Counts `frames` SSE frames (1 by default) written in one write of `bytes` bytes (UTF-8 length,
   * `\n\n` included). Runs per write per client: two counter increments, no allocation.
   */
  sseWritten: (kind: SseEventKind, bytes: number, frames?: number) => void;
  /**
   * Counts completion tokens written to a client outside a tracked request (a resumed stream: its
   * request is tracked where it started). Runs per write: a plain number, folded in at scrape.
   */
  tokensWritten: (tokens: number) => void;
  /**
   * Starts timing one accepted completion request (after validation and admission; a rejected request
   * is counted with `rejected` instead). The tracker records queue time, TTFT, inter-token latency,
   * end-to-end latency, tokens written and how the request ended.
   */
  trackRequest(options: TrackRequestOptions): RequestTracker;
}

/** How long a scrape waits for the gateway's readiness probe (a Redis PING) before it reports not ready. */
const READINESS_TIMEOUT_MS = 1_000;

/**
 * Creates the gateway's metrics in `registry` (a fresh one by default), with Node's default process
 * metrics (added once per registry). Nothing is registered until this is called.
 */
export function createGatewayMetrics(registry: Registry = new Registry(), options: GatewayMetricsOptions = {}): GatewayMetrics {
  const defaults = ensureDefaultMetrics(registry);
  const registers = [registry];
  const now = options.now ?? (() => performance.now());

  const requests = new Counter({
    name: 'sluice_gateway_requests_total',
    help: 'HTTP responses of the gateway, by route pattern and status code.',
    labelNames: ['route', 'status'] as const,
    registers,
  });
  const requestsAccepted = new Counter({
    name: 'sluice_gateway_requests_accepted_total',
    help: 'Completion requests accepted for work (validated, admitted, tracked). Equals the sum of sluice_gateway_request_outcomes_total plus the requests in flight.',
    registers,
  });
  const activeStreams = new Gauge({
    name: 'sluice_gateway_active_streams',
    help: 'SSE streams currently open to clients, resumed ones included (sluice_gateway_active_resumed_streams of them).',
    registers,
  });
  const activeResumedStreams = new Gauge({
    name: 'sluice_gateway_active_resumed_streams',
    help: 'Resumed SSE streams (GET .../{id}?stream=true) currently open to clients: part of sluice_gateway_active_streams, not of the accepted requests in flight.',
    registers,
  });
  // Observed per step of every stream: kept as plain bucket counts, folded in when read (see PendingHistogram).
  const pendingTtft = new PendingHistogram(TIME_TO_FIRST_TOKEN_BUCKETS);
  const pendingItl = new PendingHistogram(INTER_TOKEN_LATENCY_BUCKETS);
  const timeToFirstToken: Histogram = new Histogram({
    name: 'sluice_time_to_first_token_seconds',
    help: 'Time to first token as the client sees it: request received to the first content chunk written (streams only).',
    buckets: [...TIME_TO_FIRST_TOKEN_BUCKETS],
    registers,
    collect: () => pendingTtft.fold(timeToFirstToken),
  });
  const interTokenLatency: Histogram = new Histogram({
    name: 'sluice_inter_token_latency_seconds',
    help: 'Time between two consecutive content chunks written to one client stream (one observation per chunk after the first).',
    buckets: [...INTER_TOKEN_LATENCY_BUCKETS],
    registers,
    collect: () => pendingItl.fold(interTokenLatency),
  });
  const e2eRequestLatency = new Histogram({
    name: 'sluice_e2e_request_latency_seconds',
    help: 'End-to-end latency of requests that finished with stop or length: request received to the last byte written.',
    buckets: [...E2E_REQUEST_LATENCY_BUCKETS],
    registers,
  });
  const requestQueueTime = new Histogram({
    name: 'sluice_request_queue_time_seconds',
    help: "Time from a request being received to an engine scheduling it (BullMQ's queue plus the wait inside a worker's engine while its batch or KV cache is full).",
    buckets: [...QUEUE_TIME_BUCKETS],
    registers,
  });
  const requestOutcomes = new Counter({
    name: 'sluice_gateway_request_outcomes_total',
    help: 'Accepted completion requests by how they ended: stop, length, disconnect, timeout or error.',
    labelNames: ['outcome'] as const,
    registers,
  });
  const disconnects = new Counter({
    name: 'sluice_gateway_disconnects_total',
    help: 'Clients that went away before their request ended, by the stage it was in: queued, prefill or decode.',
    labelNames: ['stage'] as const,
    registers,
  });
  const timeouts = new Counter({
    name: 'sluice_gateway_timeouts_total',
    help: 'Requests the gateway ended because a deadline passed, by kind: queue, idle or deadline.',
    labelNames: ['kind'] as const,
    registers,
  });
  const slowClients = new Counter({
    name: 'sluice_gateway_slow_clients_total',
    help: 'Streams ended because their client did not read, by cause: buffer (MAX_STREAM_BUFFER_BYTES) or stall (CLIENT_STALL_TIMEOUT_MS).',
    labelNames: ['cause'] as const,
    registers,
  });
  const streamErrors = new Counter({
    name: 'sluice_gateway_stream_errors_total',
    help: 'Accepted requests that ended in an error other than a timeout (an error frame after the 200, or an error reply), by error code.',
    labelNames: ['code'] as const,
    registers,
  });
  const streamResumes = new Counter({
    name: 'sluice_gateway_stream_resumes_total',
    help: 'Streams resumed on this gateway (GET .../{id}?stream=true with a cursor).',
    registers,
  });
  const requestReplays = new Counter({
    name: 'sluice_gateway_request_replays_total',
    help: 'Completion POSTs whose Idempotency-Key named a request already admitted: delivered from its token log, not generated or charged again.',
    labelNames: ['stream'] as const,
    registers,
  });
  const streamMigrations = new Counter({
    name: 'sluice_gateway_stream_migrations_total',
    help: 'Requests this gateway moved to another worker after their worker was lost (a continuation from the token log): its streams, and found among the active jobs detached ones and ones the lost worker had taken and not accepted.',
    registers,
  });
  const streamGaps = new Counter({
    name: 'sluice_gateway_stream_gaps_total',
    help: 'Sequence gaps detected in the live delta messages of a request (lost pub/sub messages), each repaired from the token log.',
    registers,
  });
  let pendingTokens = 0;
  const streamTokens: Counter = new Counter({
    name: 'sluice_gateway_stream_tokens_total',
    help: 'Completion tokens written to clients, streaming and non-streaming, all choices.',
    registers,
    collect: () => {
      if (pendingTokens === 0) return;
      streamTokens.inc(pendingTokens);
      pendingTokens = 0;
    },
  });
  // The SSE write path runs per chunk per client, and prom-client hashes the labels on every inc even
  // through a bound child: writes add to plain numbers, moved into the counters when they are read.
  const pendingFrames = new Map<SseEventKind, number>(SSE_EVENT_KINDS.map((kind) => [kind, 0]));
  const pendingBytes = new Map<SseEventKind, number>(SSE_EVENT_KINDS.map((kind) => [kind, 0]));
  const flushPending = (counter: Counter<'kind'>, pending: Map<SseEventKind, number>): void => {
    for (const [kind, value] of pending) {
      if (value === 0) continue;
      counter.inc({ kind }, value);
      pending.set(kind, 0);
    }
  };
  const sseEvents: Counter<'kind'> = new Counter({
    name: 'sluice_gateway_sse_events_total',
    help: 'SSE frames written to clients, by kind: chunk, heartbeat, error or done.',
    labelNames: ['kind'] as const,
    registers,
    collect: () => flushPending(sseEvents, pendingFrames),
  });
  const sseBytes: Counter<'kind'> = new Counter({
    name: 'sluice_gateway_sse_bytes_total',
    help: 'Bytes of SSE frames written to clients, by kind of frame.',
    labelNames: ['kind'] as const,
    registers,
    collect: () => flushPending(sseBytes, pendingBytes),
  });
  const rejected = new Counter({
    name: 'sluice_gateway_rejected_total',
    help: 'Requests refused before any work started, by reason (the gateway error code; queue_full is the 429).',
    labelNames: ['reason'] as const,
    registers,
  });

  let readinessProbe: (() => Promise<boolean>) | undefined;
  const ready: Gauge = new Gauge({
    name: 'sluice_gateway_ready',
    help: 'Whether this gateway would answer /readyz with 200 (not draining, Redis answers, a worker is live): 1 or 0, read at each scrape. Pages on an outage while no request comes in.',
    registers,
    async collect() {
      const probe = readinessProbe;
      if (probe === undefined) return void ready.set(0);
      // A scrape never waits on a stalled Redis for more than this: it would time out whole, and the
      // gateway look down (`up` 0) for want of one gauge. Not answering within it is not ready.
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(false), READINESS_TIMEOUT_MS)));
      const answer = await Promise.race([probe().catch(() => false), late]);
      clearTimeout(timer);
      ready.set(answer ? 1 : 0);
    },
  });

  // Series that exist from the first scrape, so rate() and increase() see their first increment.
  for (const stage of REQUEST_STAGES) disconnects.labels(stage).inc(0);
  for (const outcome of REQUEST_OUTCOMES) requestOutcomes.labels(outcome).inc(0);
  for (const kind of TIMEOUT_KINDS) timeouts.labels(kind).inc(0);
  for (const cause of SLOW_CLIENT_CAUSES) slowClients.labels(cause).inc(0);
  for (const kind of SSE_EVENT_KINDS) {
    sseEvents.inc({ kind }, 0);
    sseBytes.inc({ kind }, 0);
  }

  const instruments: RequestInstruments = {
    activeStreams,
    timeToFirstToken: pendingTtft,
    interTokenLatency: pendingItl,
    e2eRequestLatency,
    requestQueueTime,
    requestOutcomes,
    disconnects,
    timeouts,
    slowClients,
    streamErrors,
    streamTokens: {
      inc: (tokens) => {
        pendingTokens += tokens;
      },
    },
  };

  const scrapes = new ScrapeWatch();
  return {
    registry,
    scrape: () => {
      defaults.takeEventLoopDelay();
      return scrapeRegistry(registry, scrapes);
    },
    nextScrape: (maxMs) => scrapes.nextScrape(maxMs),
    eventLoopDelay: defaults.eventLoopDelay,
    requests,
    requestsAccepted,
    activeStreams,
    activeResumedStreams,
    timeToFirstToken,
    interTokenLatency,
    e2eRequestLatency,
    requestQueueTime,
    requestOutcomes,
    disconnects,
    timeouts,
    slowClients,
    streamErrors,
    streamGaps,
    streamResumes,
    requestReplays,
    streamMigrations,
    streamTokens,
    sseEvents,
    sseBytes,
    rejected,
    keyUsage: createKeyUsageMetrics(registry, options.maxKeys),
    observeReadiness(probe) {
      readinessProbe = probe;
    },
    countRequest(route, status, by = 1) {
      requests.labels(route, String(status)).inc(by);
    },
    sseWritten(kind, bytes, frames = 1) {
      const seen = pendingFrames.get(kind);
      if (seen === undefined) return;
      pendingFrames.set(kind, seen + frames);
      pendingBytes.set(kind, pendingBytes.get(kind)! + bytes);
    },
    tokensWritten(tokens) {
      pendingTokens += tokens;
    },
    trackRequest({ stream, receivedAt }) {
      requestsAccepted.inc();
      return new RequestTracker(instruments, now, stream, receivedAt ?? now());
    },
  };
}
