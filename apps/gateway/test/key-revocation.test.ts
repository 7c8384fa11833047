import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import type { CancelReason } from '@sluice/protocol';
import { KeyRevocation } from '../src/auth/key-revocation.js';
import type { GatewayError } from '../src/errors.js';
import type { SessionEvent } from '../src/request-session.js';
import { SessionManager } from '../src/session-manager.js';

const LEAKED = 'a'.repeat(64);
const OTHER = 'b'.repeat(64);

function setup(missing: (hashes: readonly string[]) => Promise<string[]>) {
  const cancels: Array<{ requestId: string; reason: CancelReason; wasQueued: boolean }> = [];
  const sessions = new SessionManager(
    { queueTimeoutMs: 60_000, idleTimeoutMs: 60_000 },
    {
      cancel: (session, reason, wasQueued) => cancels.push({ requestId: session.requestId, reason, wasQueued }),
      detach: () => {},
      migrate: async () => ({ outcome: 'gone' }),
    },
    { read: async () => ({ entries: [], known: false }), meta: async () => undefined, last: async () => undefined, tail: async () => [] },
    pino({ level: 'silent' }),
  );
  const lookups: string[][] = [];
  const detachedCancels: string[] = [];
  const revocation = new KeyRevocation(
    {
      missing: async (hashes) => {
        lookups.push([...hashes]);
        return missing(hashes);
      },
    },
    sessions,
    {
      cancelDetachedOf: async (owner) => {
        detachedCancels.push(owner);
        return 0;
      },
    },
    pino({ level: 'silent' }),
  );
  const events = new Map<string, SessionEvent[]>();
  const open = (id: string, owner: string) => {
    events.set(id, []);
    return sessions.open(id, Date.now() + 60_000, (event) => events.get(id)!.push(event), { owner });
  };
  return { sessions, revocation, cancels, lookups, detachedCancels, events, open };
}

const failure = (events: SessionEvent[] | undefined) =>
  (events?.find((event) => event.type === 'failed') as { error: GatewayError } | undefined)?.error;

describe('KeyRevocation', () => {
  it('ends every session of the revoked key, and only those, with invalid_api_key, and cancels their work', () => {
    const { sessions, revocation, cancels, detachedCancels, events, open } = setup(async () => []);
    open('queued', LEAKED);
    const running = open('running', LEAKED);
    sessions.dispatch({ workerId: 'w', entries: [{ requestId: 'running', seq: 0, type: 'accepted', workerId: 'w', promptTokens: 3 }] });
    expect(running.state).toBe('running');
    open('other', OTHER);
    open('keyless', '');

    revocation.revoked(LEAKED);

    for (const id of ['queued', 'running']) {
      const error = failure(events.get(id));
      expect(error?.code).toBe('invalid_api_key');
      expect(error?.status).toBe(401);
      expect(error?.message).toMatch(/revoked/);
    }
    expect(cancels).toEqual([
      { requestId: 'queued', reason: 'key_revoked', wasQueued: true },
      { requestId: 'running', reason: 'key_revoked', wasQueued: false },
    ]);
    expect(failure(events.get('other'))).toBeUndefined();
    expect(failure(events.get('keyless'))).toBeUndefined();
    expect(sessions.size).toBe(2);
    expect(sessions.owners()).toEqual(new Set([OTHER]));
    // Its detached requests (no session here) are looked for in the queue: test/key-revocation.test.ts.
    expect(detachedCancels).toEqual([LEAKED]);
  });

  it('checks each distinct key of the open sessions once, and ends the sessions of the ones gone', async () => {
    const { revocation, lookups, events, open } = setup(async (hashes) => hashes.filter((hash) => hash === LEAKED));
    open('a', LEAKED);
    open('b', LEAKED);
    open('c', OTHER);
    open('d', '');
    await revocation.check();
    expect(lookups).toEqual([[LEAKED, OTHER]]);
    expect(failure(events.get('a'))?.code).toBe('invalid_api_key');
    expect(failure(events.get('b'))?.code).toBe('invalid_api_key');
    expect(failure(events.get('c'))).toBeUndefined();
  });

  it('reads nothing when no open session has a key', async () => {
    const { revocation, lookups, open } = setup(async () => []);
    open('keyless', '');
    await revocation.check();
    expect(lookups).toEqual([]);
  });

  it('ends nothing when the key store cannot be read', async () => {
    const { revocation, events, open } = setup(() => Promise.reject(new Error('Connection is closed.')));
    open('a', LEAKED);
    await expect(revocation.check()).resolves.toBeUndefined();
    expect(failure(events.get('a'))).toBeUndefined();
  });
});
