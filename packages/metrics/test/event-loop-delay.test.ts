import { afterEach, describe, expect, it } from 'vitest';
import { EventLoopDelay } from '../src/index.js';

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));
/** Holds the event loop for `ms` (what a blocking handler does to every other callback). */
function block(ms: number): void {
  const until = performance.now() + ms;
  while (performance.now() < until);
}

describe('EventLoopDelay', () => {
  const monitors: EventLoopDelay[] = [];
  const monitor = (resolutionMs?: number) => {
    const created = new EventLoopDelay(resolutionMs);
    monitors.push(created);
    return created;
  };
  afterEach(() => {
    for (const created of monitors.splice(0)) created.close();
  });

  it('runs no timer while no work is open, and reads an empty window as zeros', async () => {
    const delay = monitor();
    expect(delay.measuring).toBe(false);
    await sleep(50);
    expect(delay.take()).toEqual({ min: 0, max: 0, mean: 0, stddev: 0, p50: 0, p90: 0, p99: 0 });
  });

  it('measures while work is open: whole timer periods, and a blocked loop above them', async () => {
    const delay = monitor(10);
    const end = delay.begin();
    expect(delay.measuring).toBe(true);
    await sleep(60);
    block(80);
    await sleep(30);
    end();
    const window = delay.take();
    // Every sample is at least one period; the block shows as one sample of at least its length.
    expect(window.min).toBeGreaterThanOrEqual(0.009);
    expect(window.max).toBeGreaterThanOrEqual(0.08);
    expect(window.p50).toBeGreaterThanOrEqual(0.009);
    expect(window.p50).toBeLessThan(window.max);
  });

  it('stops when the last open piece of work ends, whatever the order, and an end counts once', async () => {
    const delay = monitor();
    const endA = delay.begin();
    const endB = delay.begin();
    endA();
    endA();
    expect(delay.measuring).toBe(true);
    endB();
    expect(delay.measuring).toBe(false);
  });

  it('does not count the idle time between two busy spells as a delay, and keeps both spells in the window', async () => {
    const delay = monitor(10);
    let end = delay.begin();
    await sleep(40);
    block(50);
    await sleep(20);
    end();
    // Idle far longer than anything measured: Node's own monitor, enabled again, would record this gap.
    await sleep(1_500);
    end = delay.begin();
    await sleep(40);
    end();
    const window = delay.take();
    expect(window.max).toBeGreaterThanOrEqual(0.05);
    expect(window.max).toBeLessThan(1.4);
    // The next window starts empty.
    expect(delay.take().max).toBe(0);
  });

  it('measures nothing once closed', async () => {
    const delay = monitor();
    const end = delay.begin();
    delay.close();
    expect(delay.measuring).toBe(false);
    end();
    delay.begin();
    expect(delay.measuring).toBe(false);
  });

  it('refuses a period that is not a whole number of milliseconds ≥ 1', () => {
    expect(() => new EventLoopDelay(0)).toThrow(RangeError);
    expect(() => new EventLoopDelay(2.5)).toThrow(RangeError);
  });
});
