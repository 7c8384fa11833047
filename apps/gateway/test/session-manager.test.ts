import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import type { CancelReason, GatewayEntry } from '@sluice/protocol';
import { GatewayError } from '../src/errors.js';
import type { SessionEvent } from '../src/request-session.js';
import { SessionManager } from '../src/session-manager.js';
import type { MigrationResult } from '../src/job-queue.js';
import type { TokenLog } from '../src/token-log-reader.js';

/** The token logs as the sessions see them: entries by request, in memory. */
function memoryLog() {
  const logs = new Map<string, GatewayEntry[]>();
  let reads = 0;
  let failNext = false;
  const log: TokenLog = {
    read: async (requestId, fromSeq) => {
      reads++;
      if (failNext) {
        failNext = false;
        throw new Error("Stream isn't writeable and enableOfflineQueue options is false");
      }
      const entries = logs.get(requestId);
      return { entries: (entries ?? []).filter((e) => e.seq >= fromSeq), known: entries !== undefined };
    },
    meta: async () => undefined,
    last: async (requestId) => logs.get(requestId)?.at(-1),
    tail: async (requestId, count) => (logs.get(requestId) ?? []).slice(-count),
  };
  /** The next read fails, as on a connection that is reconnecting. */
  const failNextRead = () => (failNext = true);
  return { log, logs, reads: () => reads, failNextRead };
}

function setup(options = { queueTimeoutMs: 1_000, idleTimeoutMs: 500 }) {
  const cancels: Array<{ requestId: string; reason: CancelReason; wasQueued: boolean }> = [];
  const detached: string[] = [];
  const migrations: Array<{ requestId: string; attempt: number; lostWorkerId: string }> = [];
  let migration: MigrationResult | 'refused' = { outcome: 'exhausted' };
  const { log, logs, reads, failNextRead } = memoryLog();
  const manager = new SessionManager(
    options,
    {
      cancel: (session, reason, wasQueued) => cancels.push({ requestId: session.requestId, reason, wasQueued }),
      detach: (session) => detached.push(session.requestId),
      migrate: async (requestId, attempt, lostWorkerId) => {
        migrations.push({ requestId, attempt, lostWorkerId });
        if (migration === 'refused') throw new Error('OOM command not allowed when used memory > maxmemory.');
        return migration;
      },
    },
    log,
    pino({ level: 'silent' }),
  );
  const events: SessionEvent[] = [];
  return {
    manager,
    cancels,
    detached,
    migrations,
    willMigrate: (result: MigrationResult | 'refused') => (migration = result),
    events,
    logs,
    reads,
    failNextRead,
    open: (id: string, deadlineAt = Date.now() + 60_000, graceMs = 0) => manager.open(id, deadlineAt, (e) => events.push(e), { graceMs }),
  };
}

const tick = () => new Promise((resolve) => setImmediate(resolve));

describe('SessionManager', () => {
  it('counts a session as queued until an engine schedules it, not when a worker accepts it', () => {
    const { manager, open } = setup();
    open('a');
    open('b');
    open('c');
    expect(manager.queuedCount).toBe(3);
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 }] });
    // Accepted, but waiting inside the worker's engine (batch or KV full): still queued.
    expect(manager.queuedCount).toBe(3);
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 1, type: 'scheduled' }] });
    expect(manager.queuedCount).toBe(2);
    // A worker that sends no `scheduled`: its first output counts as one.
    manager.dispatch({
      workerId: 'w',
      entries: [
        { requestId: 'b', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
        { requestId: 'b', seq: 1, type: 'text-delta', index: 0, text: 'x', tokens: 1 },
      ],
    });
    expect(manager.queuedCount).toBe(1);
    manager.close();
  });

  it('applies the queue timeout (not the idle one) to a request accepted by a worker but not yet scheduled, and cancels it there', () => {
    const { manager, cancels, events, open } = setup();
    open('a');
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 }] });
    // Past the idle timeout (500 ms) but not the queue timeout (1,000 ms): nothing happens.
    manager.sweep(Date.now() + 700);
    expect(events.at(-1)?.type).toBe('accepted');
    manager.sweep(Date.now() + 1_100);
    expect(events.at(-1)).toMatchObject({ type: 'failed', error: { code: 'queue_timeout' } });
    // The worker holds the job: the cancel goes to it (control message), not to BullMQ's queue.
    expect(cancels).toEqual([{ requestId: 'a', reason: 'timeout', wasQueued: false }]);
    expect(manager.queuedCount).toBe(0);
    manager.close();
  });

  it('applies the queue timeout (not the idle one) to a stream resumed past its `accepted` whose engine has not scheduled it', () => {
    const { manager, cancels, events } = setup();
    const resume = (id: string, scheduled: boolean) =>
      manager.open(id, Date.now() + 60_000, (e) => events.push(e), { nextSeq: 1, accepted: true, scheduled, workerId: 'w' });
    // Its log holds only the `accepted` (the cursor's event): still waiting for a place in the engine.
    resume('waiting', false);
    expect(manager.queuedCount).toBe(1);
    // Past the idle timeout (500 ms) but not the queue timeout (1,000 ms): nothing happens.
    manager.sweep(Date.now() + 700);
    expect(events).toEqual([]);
    expect(cancels).toEqual([]);
    manager.sweep(Date.now() + 1_100);
    expect(events.at(-1)).toMatchObject({ type: 'failed', error: { code: 'queue_timeout' } });
    expect(manager.queuedCount).toBe(0);
    // Once its `scheduled` entry comes, it runs: the idle timeout applies.
    resume('scheduled-later', false);
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'scheduled-later', seq: 1, type: 'scheduled' }] });
    expect(manager.queuedCount).toBe(0);
    manager.sweep(Date.now() + 700);
    expect(events.at(-1)).toMatchObject({ type: 'failed', error: { code: 'idle_timeout' } });
    manager.close();
  });

  it('ignores entries of sessions that already ended', () => {
    const { manager, events } = setup();
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'gone', seq: 4, type: 'text-delta', index: 0, text: 'x', tokens: 1 }] });
    expect(events).toEqual([]);
    manager.close();
  });

  it('repairs a sequence gap from the token log, delivering each entry once and in order', async () => {
    const { manager, events, logs, open } = setup();
    open('r');
    const entries: GatewayEntry[] = [
      { requestId: 'r', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
      { requestId: 'r', seq: 1, type: 'text-delta', index: 0, text: 'a', tokens: 1 },
      { requestId: 'r', seq: 2, type: 'text-delta', index: 0, text: 'b', tokens: 1 },
      { requestId: 'r', seq: 3, type: 'text-delta', index: 0, text: 'c', tokens: 1 },
    ];
    logs.set('r', entries);
    manager.dispatch({ workerId: 'w', entries: [entries[0]!] });
    // seq 1 and 2 were lost on the live path; 3 reveals the gap, and arrives again while the repair runs.
    manager.dispatch({ workerId: 'w', entries: [entries[3]!] });
    manager.dispatch({ workerId: 'w', entries: [entries[3]!] });
    await tick();
    manager.dispatch({ workerId: 'w', entries: [entries[2]!] });
    expect(events.map((e) => ('seq' in e ? e.seq : e.type))).toEqual([0, 1, 2, 3]);
    manager.close();
  });

  it('reads the log again, instead of failing the stream, when a repair read fails (Redis reconnecting)', async () => {
    const { manager, events, logs, failNextRead, open } = setup();
    open('r');
    const entries: GatewayEntry[] = [
      { requestId: 'r', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
      { requestId: 'r', seq: 1, type: 'text-delta', index: 0, text: 'a', tokens: 1 },
      { requestId: 'r', seq: 2, type: 'text-delta', index: 0, text: 'b', tokens: 1 },
    ];
    logs.set('r', entries);
    manager.dispatch({ workerId: 'w', entries: [entries[0]!] });
    // The gap's first read meets a connection that is not back yet.
    failNextRead();
    manager.dispatch({ workerId: 'w', entries: [entries[2]!] });
    await new Promise((resolve) => setTimeout(resolve, 400));
    expect(events.map((e) => ('seq' in e ? e.seq : e.type))).toEqual([0, 1, 2]);
    manager.close();
  });

  it('reads the log again when entries went live past what a repair read returned', async () => {
    const { manager, events, logs, reads, open } = setup();
    open('r');
    const e = (seq: number): GatewayEntry => ({ requestId: 'r', seq, type: 'text-delta', index: 0, text: String(seq), tokens: 1 });
    logs.set('r', [{ requestId: 'r', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 }, e(1)]);
    manager.dispatch({ workerId: 'w', entries: [e(1)] });
    // While the first read runs, seq 2 is logged and published.
    logs.get('r')!.push(e(2));
    manager.dispatch({ workerId: 'w', entries: [e(2)] });
    await tick();
    await tick();
    expect(events.map((x) => ('seq' in x ? x.seq : x.type))).toEqual([0, 1, 2]);
    expect(reads()).toBe(2);
    manager.close();
  });

  it('reads again, instead of failing, when an entry arrives live while a read that could not see it runs', async () => {
    const { manager, events, logs, reads, open } = setup();
    open('q');
    // The subscriber reconnected before the worker logged anything for this queued request.
    manager.repairAll();
    const accepted: GatewayEntry = { requestId: 'q', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 };
    logs.set('q', [accepted]);
    manager.dispatch({ workerId: 'w', entries: [accepted] });
    await tick();
    await tick();
    expect(events.map((e) => e.type)).toEqual(['accepted']);
    expect(reads()).toBe(2);
    manager.close();
  });

  it('repairs every open stream after the subscriber reconnected, the last entries included', async () => {
    const { manager, events, logs, open } = setup();
    open('a');
    logs.set('a', [
      { requestId: 'a', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
      { requestId: 'a', seq: 1, type: 'finish', usage: { promptTokens: 1, completionTokens: 0 } },
    ]);
    manager.repairAll();
    await tick();
    expect(events.map((e) => e.type)).toEqual(['accepted', 'finish']);
    expect(manager.size).toBe(0);
    manager.close();
  });

  it('reads the log of a stream taken over before its `accepted` once it waits quietly: its worker may have written the whole answer to the old route', async () => {
    const { manager, events, logs, reads } = setup({ queueTimeoutMs: 60_000, idleTimeoutMs: 500 });
    const taken = manager.open('moved', Date.now() + 120_000, (e) => events.push(e), { graceMs: 60_000, takenOver: true });
    const fresh = manager.open('fresh', Date.now() + 120_000, () => undefined);
    // The worker started the job before the route moved here and finished it before it heard of the
    // move: every entry went to the old route (or nowhere, detached), none came here live.
    logs.set('moved', [
      { requestId: 'moved', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
      { requestId: 'moved', seq: 1, type: 'text-delta', index: 0, text: 'hi', tokens: 1 },
      { requestId: 'moved', seq: 2, type: 'finish', usage: { promptTokens: 1, completionTokens: 1 } },
    ]);
    manager.sweep(taken.enqueuedAt + 999);
    expect(reads()).toBe(0);
    manager.sweep(taken.enqueuedAt + 1_000);
    await tick();
    expect(events.map((e) => e.type)).toEqual(['accepted', 'text-delta', 'finish']);
    // A stream opened here waits on its own route: its log is not read while it waits.
    expect(reads()).toBe(1);
    expect(fresh.state).toBe('queued');
    expect(manager.size).toBe(1);
    manager.close();
  });

  it('reads the log of a waiting stream another gateway took over (its route-moved broadcast): its entries all go there', async () => {
    const { manager, events, logs, reads, open } = setup({ queueTimeoutMs: 60_000, idleTimeoutMs: 5_000 });
    const session = open('twice');
    manager.routeMovedAway('elsewhere');
    manager.sweep(session.enqueuedAt + 1_000);
    expect(reads()).toBe(0);
    manager.routeMovedAway('twice');
    logs.set('twice', [
      { requestId: 'twice', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
      { requestId: 'twice', seq: 1, type: 'scheduled' },
    ]);
    manager.sweep(session.enqueuedAt + 1_000);
    await tick();
    expect(events.map((e) => e.type)).toEqual(['accepted', 'scheduled']);
    // Running now, and quiet: the sweep goes on reading (as for any quiet running stream).
    logs.get('twice')!.push({ requestId: 'twice', seq: 2, type: 'finish', usage: { promptTokens: 1, completionTokens: 0 } });
    manager.sweep(session.enqueuedAt + 2_100);
    await tick();
    expect(events.map((e) => e.type)).toEqual(['accepted', 'scheduled', 'finish']);
    expect(manager.size).toBe(0);
    manager.close();
  });

  it('reads the log of a waiting stream after the subscriber reconnected: a route-moved sent meanwhile is gone', async () => {
    const { manager, events, logs, reads, open } = setup({ queueTimeoutMs: 60_000, idleTimeoutMs: 5_000 });
    const session = open('waiting');
    manager.repairAll();
    await tick();
    expect(reads()).toBe(1);
    // Its entries went to another gateway that took it over while the subscriber was away.
    logs.set('waiting', [{ requestId: 'waiting', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 }]);
    manager.sweep(session.enqueuedAt + 1_000);
    await tick();
    expect(events.map((e) => e.type)).toEqual(['accepted']);
    expect(reads()).toBe(2);
    manager.close();
  });

  it('reads the log of a taken-over stream that still waits at most once per quiet second', async () => {
    const { manager, reads } = setup({ queueTimeoutMs: 60_000, idleTimeoutMs: 500 });
    const taken = manager.open('moved', Date.now() + 120_000, () => undefined, { graceMs: 60_000, takenOver: true });
    manager.sweep(taken.enqueuedAt + 1_000);
    await tick();
    manager.sweep(taken.enqueuedAt + 1_500);
    await tick();
    expect(reads()).toBe(1);
    manager.sweep(taken.enqueuedAt + 2_000);
    await tick();
    expect(reads()).toBe(2);
    // Still queued: an empty log of a known request loses nothing.
    expect(taken.state).toBe('queued');
    manager.close();
  });

  it('fails a stream only when the log lacks the missing entries', async () => {
    const { manager, events, logs, open } = setup();
    open('trimmed');
    open('lost');
    logs.set('trimmed', [{ requestId: 'trimmed', seq: 3, type: 'text-delta', index: 0, text: 'x', tokens: 1 }]);
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'trimmed', seq: 3, type: 'text-delta', index: 0, text: 'x', tokens: 1 }] });
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'lost', seq: 1, type: 'text-delta', index: 0, text: 'x', tokens: 1 }] });
    await tick();
    expect(events).toMatchObject([
      { type: 'failed', error: { code: 'stream_interrupted' } },
      { type: 'failed', error: { code: 'stream_interrupted' } },
    ]);
    manager.close();
  });

  it('fences out entries of a superseded attempt', () => {
    const { manager, events, open } = setup();
    const session = open('f');
    session.attempt = 2;
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'f', seq: 0, type: 'accepted', workerId: 'old', promptTokens: 1 }] });
    manager.dispatch({
      workerId: 'w',
      entries: [{ requestId: 'f', seq: 0, attempt: 2, type: 'accepted', workerId: 'new', promptTokens: 1 }],
    });
    expect(events).toMatchObject([{ type: 'accepted', workerId: 'new' }]);
    manager.close();
  });

  it('fences out live entries of an attempt another gateway moved on before its worker accepted (attempt-moved)', () => {
    const { manager, events, open } = setup();
    open('waiting');
    manager.attemptMoved('waiting', 2);
    // The old worker only looked dead: what it publishes after the move is in no log.
    manager.dispatch({ workerId: 'old', entries: [{ requestId: 'waiting', seq: 0, type: 'accepted', workerId: 'old', promptTokens: 1 }] });
    manager.dispatch({
      workerId: 'new',
      entries: [{ requestId: 'waiting', seq: 0, attempt: 2, type: 'accepted', workerId: 'new', promptTokens: 1 }],
    });
    expect(events).toMatchObject([{ type: 'accepted', workerId: 'new' }]);
    // An older announcement (or one of a request not held here) changes nothing.
    manager.attemptMoved('waiting', 1);
    manager.attemptMoved('elsewhere', 5);
    manager.dispatch({
      workerId: 'new',
      entries: [{ requestId: 'waiting', seq: 1, attempt: 2, type: 'text-delta', index: 0, text: 'a', tokens: 1 }],
    });
    expect(events.map((e) => e.type)).toEqual(['accepted', 'text-delta']);
    manager.close();
  });

  it('lets a request with a resume grace outlive its client instead of cancelling it', () => {
    const { manager, cancels, detached, open } = setup();
    manager.clientLeft(open('graced', Date.now() + 60_000, 5_000));
    manager.clientLeft(open('plain'));
    expect(detached).toEqual(['graced']);
    expect(cancels).toEqual([{ requestId: 'plain', reason: 'client_closed', wasQueued: true }]);
    expect(manager.size).toBe(0);
    manager.close();
  });

  it('hands a stream resumed on the same gateway to the new connection; the old one ends, superseded, without cancelling', () => {
    const { manager, cancels, events, open } = setup();
    const first = open('r', Date.now() + 60_000, 5_000);
    const second = manager.open('r', Date.now() + 60_000, () => events.push({ type: 'failed', error: new Error('second') as never }), {
      graceMs: 5_000,
    });
    // Not a failure of the request: its work goes on for the new connection (what the key holds stays held).
    expect(events).toMatchObject([{ type: 'superseded', error: { code: 'stream_interrupted' } }]);
    // The old connection's close arrives late: it must not touch the new session.
    manager.clientLeft(first);
    expect(manager.size).toBe(1);
    expect(second.state).toBe('queued');
    expect(cancels).toEqual([]);
    manager.close();
  });

  it('tells the responders of the streams it detaches at shutdown that their work goes on, and cancels the rest', () => {
    const { manager, cancels, detached, events, open } = setup();
    open('graced', Date.now() + 60_000, 5_000);
    open('plain');
    manager.shutDown(new GatewayError('shutting_down'));
    expect(detached).toEqual(['graced']);
    expect(cancels).toEqual([{ requestId: 'plain', reason: 'shutdown', wasQueued: true }]);
    expect(events).toEqual([
      { type: 'failed', error: expect.objectContaining({ code: 'shutting_down' }) as unknown, detached: true },
      { type: 'failed', error: expect.objectContaining({ code: 'shutting_down' }) as unknown },
    ]);
    manager.close();
  });

  it('says whether a client that left leaves its work running', () => {
    const { manager, open } = setup();
    const graced = open('graced', Date.now() + 60_000, 5_000);
    expect(manager.clientLeft(graced)).toBe(true);
    expect(manager.clientLeft(graced)).toBe(false);
    expect(manager.clientLeft(open('plain'))).toBe(false);
    manager.close();
  });

  it('passes on an error entry out of sequence (a job BullMQ retried reports worker_lost from seq 0)', () => {
    const { manager, events, open } = setup();
    open('retried');
    const delta = { seq: 0, type: 'text-delta' as const, index: 0, text: 'x', tokens: 1 };
    manager.dispatch({
      workerId: 'w',
      entries: [
        { requestId: 'retried', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
        { requestId: 'retried', ...delta, seq: 1 },
      ],
    });
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
    manager.dispatch({
      workerId: 'w',
      entries: [
        { requestId: 'a', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
        { requestId: 'a', seq: 1, type: 'scheduled' },
      ],
    });
    manager.sweep(Date.now() + 600);
    expect(events.at(-1)).toMatchObject({ type: 'failed', error: { code: 'idle_timeout' } });
    expect(cancels).toEqual([{ requestId: 'a', reason: 'timeout', wasQueued: false }]);
    manager.close();
  });

  it('counts the idle and queue timeouts only from when a stopped process woke up, whose entries are still unread', async () => {
    const { manager, events, logs, open } = setup();
    open('running');
    open('queued');
    const entries: GatewayEntry[] = [
      { requestId: 'running', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 1 },
      { requestId: 'running', seq: 1, type: 'scheduled' },
    ];
    // (In its log as well: a quiet stream's sweep reads the log once a second.)
    logs.set('running', entries);
    manager.dispatch({ workerId: 'w', entries });
    // The loop blocked past both timeouts (500 ms idle, 1,000 ms queue), as a process stopped with
    // SIGSTOP: no timer, no socket read runs meanwhile.
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 1_200);
    // Awake: the sweep timer (every 50 ms here) runs first, the worker's entries come after it.
    await new Promise((resolve) => setTimeout(resolve, 120));
    expect(events.filter((e) => e.type === 'failed')).toEqual([]);
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'running', seq: 2, type: 'text-delta', index: 0, text: 'x', tokens: 1 }] });
    expect(events.at(-1)).toMatchObject({ type: 'text-delta', seq: 2 });
    // Awake and silent past the idle timeout: it applies again.
    await new Promise((resolve) => setTimeout(resolve, 700));
    expect(events.find((e) => e.type === 'failed')).toMatchObject({ error: { code: 'idle_timeout' } });
    manager.close();
  });

  it('fails a session past its deadline whatever its state', () => {
    const { manager, events, open } = setup();
    const session = open('a', Date.now() + 100);
    manager.sweep(session.deadlineAt);
    expect(events).toMatchObject([{ type: 'failed', error: { code: 'deadline_exceeded' } }]);
    manager.close();
  });

  it('moves the sessions of a worker missing from a registry snapshot taken after it accepted to a new attempt', async () => {
    const { manager, events, logs, migrations, willMigrate, open } = setup();
    open('a');
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 }] });
    const acceptedAt = Date.now();
    // A snapshot older than the accept says nothing about this worker.
    manager.failLostWorkers(new Set(), acceptedAt - 10);
    expect(migrations).toEqual([]);
    willMigrate({ outcome: 'migrated', attempt: 2 });
    // What the lost worker logged before it was fenced out, then the continuation's first entries.
    logs.set('a', [
      { requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 },
      { requestId: 'a', seq: 1, type: 'text-delta', index: 0, text: 'x', tokens: 1 },
    ]);
    manager.failLostWorkers(new Set(['w2']), acceptedAt + 1);
    expect(migrations).toEqual([{ requestId: 'a', attempt: 1, lostWorkerId: 'w1' }]);
    // The lost worker, only frozen, publishes again: fenced out, live and while the move is decided.
    manager.dispatch({ workerId: 'w1', entries: [{ requestId: 'a', seq: 2, type: 'text-delta', index: 0, text: 'stale', tokens: 1 }] });
    await tick();
    await tick();
    manager.dispatch({ workerId: 'w1', entries: [{ requestId: 'a', seq: 2, type: 'text-delta', index: 0, text: 'stale', tokens: 1 }] });
    manager.dispatch({
      workerId: 'w2',
      entries: [{ requestId: 'a', seq: 2, attempt: 2, type: 'accepted', workerId: 'w2', promptTokens: 1, continued: true }],
    });
    manager.dispatch({
      workerId: 'w2',
      entries: [{ requestId: 'a', seq: 3, attempt: 2, type: 'text-delta', index: 0, text: 'y', tokens: 1 }],
    });
    expect(events.map((e) => (e.type === 'text-delta' ? e.text : e.type))).toEqual(['accepted', 'x', 'accepted', 'y']);
    manager.close();
  });

  it('tries the move again at the next registry poll when Redis refused it, instead of ending the stream', async () => {
    const { manager, events, logs, migrations, willMigrate, open } = setup();
    open('a');
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 }] });
    willMigrate('refused');
    manager.failLostWorkers(new Set(), Date.now() + 1);
    await tick();
    expect(events.filter((e) => e.type === 'failed')).toEqual([]);
    willMigrate({ outcome: 'migrated', attempt: 2 });
    logs.set('a', [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 }]);
    manager.failLostWorkers(new Set(), Date.now() + 1);
    await tick();
    expect(migrations.map((m) => m.lostWorkerId)).toEqual(['w1', 'w1']);
    manager.dispatch({
      workerId: 'w2',
      entries: [{ requestId: 'a', seq: 1, attempt: 2, type: 'text-delta', index: 0, text: 'y', tokens: 1 }],
    });
    expect(events.map((e) => (e.type === 'text-delta' ? e.text : e.type))).toEqual(['accepted', 'y']);
    manager.close();
  });

  it('ends a stream whose continuation starts before what it delivered (its log lacked live entries), instead of duplicating text', () => {
    const { manager, events, open } = setup();
    open('a');
    const delta = (seq: number, text: string, attempt?: number): GatewayEntry => ({
      requestId: 'a',
      seq,
      type: 'text-delta',
      index: 0,
      text,
      tokens: 1,
      ...(attempt === undefined ? {} : { attempt }),
    });
    manager.dispatch({
      workerId: 'w1',
      entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 }, delta(1, 'a'), delta(2, 'b'), delta(3, 'c')],
    });
    // Its log held seq 0–1 only (appends refused, publishes delivered): the continuation goes on from 2.
    manager.dispatch({
      workerId: 'w2',
      entries: [
        { requestId: 'a', seq: 2, attempt: 2, type: 'accepted', workerId: 'w2', promptTokens: 1, continued: true },
        delta(3, 'b', 2),
        delta(4, 'c', 2),
      ],
    });
    expect(events.map((e) => (e.type === 'text-delta' ? e.text : e.type))).toEqual(['accepted', 'a', 'b', 'c', 'failed']);
    expect(events.at(-1)).toMatchObject({ error: { code: 'stream_interrupted' } });
    manager.close();
  });

  it('takes a continuation’s first entry arriving twice (live, then again from the log) as the duplicate it is', () => {
    const { manager, events, open } = setup();
    open('a');
    const accepted: GatewayEntry = {
      requestId: 'a',
      seq: 2,
      attempt: 2,
      type: 'accepted',
      workerId: 'w2',
      promptTokens: 1,
      continued: true,
    };
    manager.dispatch({
      workerId: 'w1',
      entries: [
        { requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 },
        { requestId: 'a', seq: 1, type: 'text-delta', index: 0, text: 'a', tokens: 1 },
      ],
    });
    manager.dispatch({
      workerId: 'w2',
      entries: [accepted, { requestId: 'a', seq: 3, attempt: 2, type: 'text-delta', index: 0, text: 'b', tokens: 1 }],
    });
    manager.dispatch({ workerId: 'w2', entries: [accepted] });
    manager.dispatch({
      workerId: 'w2',
      entries: [{ requestId: 'a', seq: 4, attempt: 2, type: 'text-delta', index: 0, text: 'c', tokens: 1 }],
    });
    expect(events.map((e) => (e.type === 'text-delta' ? e.text : e.type))).toEqual(['accepted', 'a', 'accepted', 'b', 'c']);
    manager.close();
  });

  it('ends a stream with worker_lost once it used up its migrations', async () => {
    const { manager, events, open } = setup();
    open('a');
    manager.dispatch({ workerId: 'w', entries: [{ requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 }] });
    manager.failLostWorkers(new Set(), Date.now() + 1);
    await tick();
    expect(events.at(-1)).toMatchObject({ type: 'failed', error: { code: 'worker_lost' } });
    manager.close();
  });

  it('ends a stream its lost worker finished in the log, when there is nothing left to move, with the log’s ending', async () => {
    const { manager, events, logs, open, willMigrate } = setup();
    open('a');
    const accepted = { requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 1 } as const;
    manager.dispatch({ workerId: 'w1', entries: [accepted] });
    // The worker wrote the rest and its finish, its job settled, and it died (or only looked dead)
    // before those entries reached this gateway live: the move finds no job to continue.
    logs.set('a', [
      accepted,
      { requestId: 'a', seq: 1, type: 'text-delta', index: 0, text: 'hi', tokens: 1 },
      { requestId: 'a', seq: 2, type: 'text-end', index: 0, finishReason: 'stop' },
      { requestId: 'a', seq: 3, type: 'finish', usage: { promptTokens: 1, completionTokens: 1 } },
    ]);
    willMigrate({ outcome: 'gone' });
    manager.failLostWorkers(new Set(), Date.now() + 1);
    await tick();
    await tick();
    expect(events.map((e) => e.type)).toEqual(['accepted', 'text-delta', 'text-end', 'finish']);
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
