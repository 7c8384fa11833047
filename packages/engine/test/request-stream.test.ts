import { describe, expect, it } from 'vitest';
import { RequestStream } from '../src/request-stream.js';
import type { EngineEvent } from '../src/types.js';

function stream(n = 1) {
  const cancels: number[] = [];
  const s = new RequestStream({
    n,
    promptTokens: 3,
    submittedAt: performance.timeOrigin + performance.now(),
    cancel: () => cancels.push(1),
  });
  return { s, cancels };
}

const delta = (index: number, token: number): EngineEvent => ({ type: 'text-delta', index, tokenIds: [token], text: 'x' });

describe('RequestStream', () => {
  it('yields pushed events in order and ends after finish', async () => {
    const { s } = stream();
    s.push(delta(0, 5));
    s.push({ type: 'text-end', index: 0, finishReason: 'length' });
    s.push({ type: 'finish', usage: { promptTokens: 3, completionTokens: 1 }, timings: { queueMs: 0, prefillMs: 0, firstTokenMs: 0 } });
    const events: EngineEvent[] = [];
    for await (const event of s) events.push(event);
    expect(events.map((event) => event.type)).toEqual(['text-delta', 'text-end', 'finish']);
  });

  it('cancels the request when the reader stops early, and not after it finished', async () => {
    const { s, cancels } = stream();
    s.push(delta(0, 5));
    for await (const _ of s) break;
    expect(cancels).toHaveLength(1);
    const done = stream();
    done.s.endHere('stop');
    for await (const _ of done.s) break;
    expect(done.cancels).toHaveLength(0);
  });

  it('ends open choices and counts tokens when ended without the engine', async () => {
    const { s } = stream(2);
    s.push(delta(1, 4));
    s.push({ type: 'text-end', index: 1, finishReason: 'stop' });
    s.endHere('error', { code: 'internal', message: 'thread died' });
    const events: EngineEvent[] = [];
    for await (const event of s) events.push(event);
    expect(events.slice(2)).toMatchObject([
      { type: 'text-end', index: 0, finishReason: 'error' },
      { type: 'finish', usage: { promptTokens: 3, completionTokens: 1 }, error: { code: 'internal' } },
    ]);
  });

  it('resolves a waiting reader as a microtask of the push', async () => {
    const { s } = stream();
    const pending = s.next();
    let order = '';
    setTimeout(() => (order += 'timer'), 0);
    setTimeout(() => {
      s.push(delta(0, 1));
      void pending.then(() => (order += 'event'));
      setTimeout(() => (order += ',timer2'), 0);
    }, 1);
    await new Promise((resolve) => setTimeout(resolve, 20));
    expect(order).toBe('timerevent,timer2');
  });
});
