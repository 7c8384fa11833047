/**
 * The gateway's spans of one request, for its `Server-Timing` header (ms on the `performance.now()`
 * clock): what the caller can see of where its time to the answer went, without logs or metrics.
 *
 * - `admit`: the request received → its body read, validated and tokenized;
 * - `queue`: → a worker accepted it (the enqueue, the worker's pickup and its checks);
 * - `generate` (complete replies only): → the answer was whole.
 *
 * A stream sends its headers before its answer: at once with HEADERS_WAIT_MS=0 (the default: `admit`
 * only), else when a worker accepts it within HEADERS_WAIT_MS (`admit` and `queue`).
 */
export class RequestTiming {
  acceptedAt = 0;

  constructor(
    readonly receivedAt: number,
    readonly preparedAt: number,
  ) {}

  /** The worker's accept (the first one: a continuation elsewhere keeps it). */
  accepted(now = performance.now()): void {
    if (this.acceptedAt === 0) this.acceptedAt = now;
  }

  /** @param doneAt when the answer was whole (complete replies), else 0 */
  header(doneAt = 0): string {
    const spans = [`admit;dur=${ms(this.preparedAt - this.receivedAt)}`];
    if (this.acceptedAt !== 0) {
      spans.push(`queue;dur=${ms(this.acceptedAt - this.preparedAt)}`);
      if (doneAt !== 0) spans.push(`generate;dur=${ms(doneAt - this.acceptedAt)}`);
    }
    return spans.join(', ');
  }
}

const ms = (value: number): string => String(Math.round(Math.max(0, value) * 1000) / 1000);
