import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import type { CancelReason } from '@sluice/protocol';
import type { SessionEvent } from '../src/request-session.js';
import { SessionManager } from '../src/session-manager.js';

function setup() {
  const cancels: Array<{ requestId: string; reason: CancelReason; wasQueued: boolean }> = [];
  const manager = new SessionManager(
    { queueTimeoutMs: 1_000, idleTimeoutMs: 500 },
    { cancel: (session, reason, wasQueued) => cancels.push({ requestId: session.requestId, reason, wasQueued }) },
    pino({ level: 'silent' }),
  );
  const events: SessionEvent[] = [];
  return { manager, cancels, events, open: (id: string, deadlineAt = Date.now() + 60_000) => manager.open(id, deadlineAt, (e) => events.push(e)) };
}

describe('SessionManager', () => {
  it('counts queued sessions until a worker accepts them', () => {
    const { manager, open } = setup();
    open('a');
    open('b');
    expect(manager.queuedCount).toBe(2);
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 }] });
    expect(manager.queuedCount).toBe(1);
    manager.close();
  });

  it('ignores entries of sessions that already ended', () => {
    const { manager, events } = setup();
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'gone', seq: 4, type: 'text-delta', index: 0, text: 'x', tokens: 1 }] });
    expect(events).toEqual([]);
    manager.close();
  });

  it('ends a stream with a gap as stream_interrupted, but passes on an error entry out of sequence', () => {
    const { manager, events, open } = setup();
    open('gap');
    open('retried');
    const delta = { seq: 0, type: 'text-delta' as const, index: 0, text: 'x', tokens: 1 };
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'gap', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 }, { requestId: 'gap', ...delta, seq: 2 }] });
    expect(events.at(-1)).toMatchObject({ type: 'failed', error: { code: 'stream_interrupted' } });
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'retried', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 }, { requestId: 'retried', ...delta, seq: 1 }] });
    const lost = { code: 'worker_lost' as const, message: 'The worker serving the request stopped.', param: null };
    manager.dispatch({ workerId: 'w2', entries: [{ requestId: 'retried', seq: 0, type: 'error', error: lost }] });
    expect(events.at(-1)).toMatchObject({ type: 'error', error: { code: 'worker_lost' } });
    expect(manager.size).toBe(0);
    manager.close();
  });

  it('fails a queued session at the queue timeout and removes its job', () => {
    const { manager, cancels, events, open } = setup();
    const session = open('a');
    manager.sweep(session.enqueuedAt + 999);
    expect(events).toEqual([]);
    manager.sweep(session.enqueuedAt + 1_000);
    expect(events).toMatchObject([{ type: 'failed', error: { code: 'queue_timeout' } }]);
    expect(cancels).toEqual([{ requestId: 'a', reason: 'timeout', wasQueued: true }]);
    expect(manager.size).toBe(0);
    manager.close();
  });

  it('fails a running session that sends nothing for the idle timeout', () => {
    const { manager, cancels, events, open } = setup();
    open('a');
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 }] });
    manager.sweep(Date.now() + 600);
    expect(events.at(-1)).toMatchObject({ type: 'failed', error: { code: 'idle_timeout' } });
    expect(cancels).toEqual([{ requestId: 'a', reason: 'timeout', wasQueued: false }]);
    manager.close();
  });

  it('fails a session past its deadline whatever its state', () => {
    const { manager, events, open } = setup();
    const session = open('a', Date.now() + 100);
    manager.sweep(session.deadlineAt);
    expect(events).toMatchObject([{ type: 'failed', error: { code: 'deadline_exceeded' } }]);
    manager.close();
  });

  it('fails the sessions of a worker missing from a registry snapshot taken after it accepted', () => {
    const { manager, events, open } = setup();
    open('a');
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 }] });
    const acceptedAt = Date.now();
    // A snapshot older than the accept says nothing about this worker.
    manager.failLostWorkers(new Set(), acceptedAt - 10);
    expect(events.filter((e) => e.type === 'failed')).toEqual([]);
    manager.failLostWorkers(new Set(['w2']), acceptedAt + 1);
    expect(events.at(-1)).toMatchObject({ type: 'failed', error: { code: 'worker_lost' } });
    manager.close();
  });

  it('resolves whenEmpty once the last session ends', async () => {
    const { manager, open } = setup();
    const session = open('a');
    const empty = manager.whenEmpty();
    manager.cancel(session, 'client_closed');
    await expect(empty).resolves.toBeUndefined();
    manager.close();
  });
});
