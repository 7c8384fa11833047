/**
 * Histogram bucket bounds (upper bounds, `le`), shared by both apps so that the dashboard's quantiles
 * mean the same thing on every process. Each list is dense where the answer is decided: a millisecond
 * apart at the low end of inter-token latency, minutes apart at the high end of end-to-end latency.
 * vLLM uses 0.01 s as its lowest inter-token bucket; on a small model one step can take a millisecond,
 * so ours starts lower. Every list has 1 and 2 (seconds or units) so a `le="1"` or `le="2"` SLO query
 * reads an exact bucket instead of interpolating.
 */

/** Time to first token as the client sees it: 5 ms to 60 s. */
export const TIME_TO_FIRST_TOKEN_BUCKETS: readonly number[] = [
  0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60,
];

/** Gap between two content writes to one client: 1 ms to 10 s. */
export const INTER_TOKEN_LATENCY_BUCKETS: readonly number[] = [
  0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10,
];

/** Whole request, received to last byte: 50 ms to 20 min. */
export const E2E_REQUEST_LATENCY_BUCKETS: readonly number[] = [
  0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 300, 450, 600, 900, 1200,
];

/** Waiting before any work: 1 ms to 10 min. */
export const QUEUE_TIME_BUCKETS: readonly number[] = [
  0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
];

/** One engine step, or the model run inside it: 0.5 ms to 10 s. */
export const STEP_TIME_BUCKETS: readonly number[] = [
  0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10,
];

/** Sequences decoded together in one step. */
export const BATCH_SIZE_BUCKETS: readonly number[] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256];

/** Tokens fed to the model in one step (vLLM's iteration tokens). */
export const STEP_TOKENS_BUCKETS: readonly number[] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192];

/** Prompt or completion length of one request, 1-2-5 steps as in vLLM. */
export const REQUEST_TOKENS_BUCKETS: readonly number[] = [
  1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 200_000,
];
