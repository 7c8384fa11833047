import type { Registry } from 'prom-client';

/**
 * When Prometheus scrapes this process, so that a stopping process can wait for one more scrape after
 * its last request ended. Its final counts (the outcomes of the streams a gateway drained, the tokens
 * of a worker's last steps) are otherwise never read: the process, and its series with it, are gone
 * before the next scrape, and `increase()` over a redeploy misses them.
 */
export class ScrapeWatch {
  /** When the latest scrape began to read the registry (ms since the epoch). */
  #last: number | undefined;
  #interval: number | undefined;
  #waiters: Array<{ since: number; resolve: () => void }> = [];

  /**
   * A scrape read the registry.
   * @param startedAt when it began reading (a read that began before a wait does not end it)
   */
  scraped(startedAt: number): void {
    if (this.#last !== undefined && startedAt > this.#last) this.#interval = startedAt - this.#last;
    this.#last = startedAt;
    this.#waiters = this.#waiters.filter((waiter) => {
      if (waiter.since > startedAt) return true;
      waiter.resolve();
      return false;
    });
  }

  /**
   * Resolves once a scrape that began from now on has read the registry. Only a process scraped at a
   * steady pace waits (two scrapes seen): at most 2 × the latest interval + 5 s, and `maxMs`.
   * @param maxMs the longest wait; 0: none
   */
  nextScrape(maxMs: number): Promise<void> {
    if (this.#interval === undefined || maxMs <= 0) return Promise.resolve();
    const waitMs = Math.min(maxMs, this.#interval * 2 + 5000);
    return new Promise((resolve) => {
      const waiter = { since: Date.now(), resolve: () => (clearTimeout(timer), resolve()) };
      const timer = setTimeout(() => {
        this.#waiters = this.#waiters.filter((w) => w !== waiter);
        resolve();
      }, waitMs);
      this.#waiters.push(waiter);
    });
  }
}

/** Reads `registry` for a scrape and notes it in `scrapes`. */
export async function scrapeRegistry(registry: Registry, scrapes: ScrapeWatch): Promise<string> {
  const startedAt = Date.now();
  const body = await registry.metrics();
  scrapes.scraped(startedAt);
  return body;
}
