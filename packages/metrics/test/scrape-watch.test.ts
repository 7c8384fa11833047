import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { ScrapeWatch } from '../src/scrape-watch.js';

describe('ScrapeWatch', () => {
  beforeEach(() => vi.useFakeTimers({ now: 100_000 }));
  afterEach(() => vi.useRealTimers());

  const settled = async (promise: Promise<void>) => {
    let done = false;
    void promise.then(() => (done = true));
    await vi.advanceTimersByTimeAsync(0);
    return done;
  };

  it('does not wait when it was scraped fewer than twice, or with no bound', async () => {
    const watch = new ScrapeWatch();
    expect(await settled(watch.nextScrape(10_000))).toBe(true);
    watch.scraped(Date.now());
    expect(await settled(watch.nextScrape(10_000))).toBe(true);
    watch.scraped(Date.now() + 5_000);
    expect(await settled(watch.nextScrape(0))).toBe(true);
  });

  it('resolves at the next scrape that began after the wait, not at one that began before', async () => {
    const watch = new ScrapeWatch();
    watch.scraped(Date.now() - 10_000);
    watch.scraped(Date.now() - 5_000);
    const before = Date.now();
    vi.advanceTimersByTime(10);
    const next = watch.nextScrape(60_000);
    // A read that began before the wait (its counts may be older than the last request's end).
    watch.scraped(before);
    expect(await settled(next)).toBe(false);
    watch.scraped(Date.now());
    expect(await settled(next)).toBe(true);
  });

  it('gives up after 2 × the last interval + 5 s, or the bound when smaller', async () => {
    const watch = new ScrapeWatch();
    watch.scraped(Date.now() - 4_000);
    watch.scraped(Date.now());
    const paced = watch.nextScrape(60_000);
    await vi.advanceTimersByTimeAsync(12_999);
    expect(await settled(paced)).toBe(false);
    await vi.advanceTimersByTimeAsync(1);
    expect(await settled(paced)).toBe(true);
    const bounded = watch.nextScrape(2_000);
    await vi.advanceTimersByTimeAsync(2_000);
    expect(await settled(bounded)).toBe(true);
  });
});
