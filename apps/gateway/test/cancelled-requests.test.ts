import { describe, expect, it } from 'vitest';
import { CancelledRequests } from '../src/cancelled-requests.js';
import type { RequestSession } from '../src/request-session.js';

const session = (requestId: string) => ({ requestId }) as RequestSession;

describe('CancelledRequests', () => {
  it('sends a cancel again for entries that keep coming, at most once per interval, until the last entry', () => {
    const cancelled = new CancelledRequests(60_000, 1_000);
    cancelled.add(session('r1'), 'client_closed', 0);
    // Entries of the steps run before the worker heard the first cancel: expected, not a loss yet.
    expect(cancelled.stillRunning('r1', false, 500)).toBeUndefined();
    expect(cancelled.stillRunning('r1', false, 1_000)).toMatchObject({ reason: 'client_closed', session: { requestId: 'r1' } });
    expect(cancelled.stillRunning('r1', false, 1_500)).toBeUndefined();
    expect(cancelled.stillRunning('r1', false, 2_000)).toBeDefined();
    // Its last entry: the request stopped; nothing more to send.
    expect(cancelled.stillRunning('r1', true, 5_000)).toBeUndefined();
    expect(cancelled.size).toBe(0);
    expect(cancelled.stillRunning('r1', false, 9_000)).toBeUndefined();
    // A request this gateway never cancelled (detached, moved elsewhere) is none of its business.
    expect(cancelled.stillRunning('other', false, 9_000)).toBeUndefined();
  });

  it('forgets cancels after a while', () => {
    const cancelled = new CancelledRequests(60_000, 1_000);
    cancelled.add(session('old'), 'timeout', 0);
    cancelled.add(session('new'), 'timeout', 30_000);
    cancelled.sweep(60_000);
    expect(cancelled.size).toBe(1);
    expect(cancelled.stillRunning('old', false, 61_000)).toBeUndefined();
    expect(cancelled.stillRunning('new', false, 61_000)).toBeDefined();
  });
});
