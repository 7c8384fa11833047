import {
  encodeEntry,
  endsRequest,
  liveGatewayMessage,
  type EntriesWritten,
  type LogAppend,
  type Publish,
  type RequestScripts,
} from '@sluice/protocol';
import type { EntryDraft } from './event-entries.js';

/** A request whose entries a batch carries: who writes them, and for whom. */
export interface BatchTarget {
  readonly requestId: string;
  readonly attempt: number;
}

interface PendingAppend {
  /** seq, json, seq, json, ... (the script's argument tail). */
  pairs: string[];
  /** The worker an `accepted` among them names ('' when none). */
  workerId: string;
  /** The request's last entry is among them (finish, error, rejected). */
  final: boolean;
}

/** One write that left: its requests and channels in the order of `written`'s replies. */
export interface BatchWrite<T extends BatchTarget> {
  targets: T[];
  channels: string[];
  written: Promise<EntriesWritten>;
}

/**
 * The entries of one write (a step): each numbered and serialized once (`encodeEntry`: the whole entry
 * for its request's token log, the live form without token ids for its gateway's message); then ONE
 * command carries them all (`RequestScripts.writeEntries`, a Lua script): an append per request,
 * fenced by attempt, then one PUBLISH per gateway channel. Appends come first, so an entry a gateway
 * sees live is always in the log already.
 */
export class StepBatch<T extends BatchTarget> {
  #logs = new Map<T, PendingAppend>();
  #channels = new Map<string, string[]>();

  get empty(): boolean {
    return this.#logs.size === 0 && this.#channels.size === 0;
  }

  /** Adds `draft` as entry `seq` of `target`'s request; live to `channel` unless null (detached). */
  add(target: T, channel: string | null, seq: number, draft: EntryDraft): void {
    const entry = { ...draft, requestId: target.requestId, seq, ...(target.attempt > 1 ? { attempt: target.attempt } : {}) };
    const { logged, live } = encodeEntry(entry);
    const log = this.#logs.get(target);
    const workerId = draft.type === 'accepted' ? draft.workerId : '';
    if (log === undefined) this.#logs.set(target, { pairs: [String(seq), logged], workerId, final: endsRequest(draft) });
    else {
      log.pairs.push(String(seq), logged);
      if (workerId !== '') log.workerId = workerId;
      if (endsRequest(draft)) log.final = true;
    }
    if (channel !== null) {
      const entries = this.#channels.get(channel);
      if (entries === undefined) this.#channels.set(channel, [live]);
      else entries.push(live);
    }
  }

  /** The requests with entries here (what a write of the batch would carry). */
  targets(): IterableIterator<T> {
    return this.#logs.keys();
  }

  /** Drops everything added (nothing of it can be written). */
  clear(): void {
    this.#logs = new Map();
    this.#channels = new Map();
  }

  /**
   * Writes everything added in one command and empties the batch. `ttlMs` gives each request's log
   * TTL from now (`final`: its last entry is in this write).
   */
  write(
    scripts: RequestScripts,
    options: { workerId: string; maxEntries: number; ttlMs: (target: T, final: boolean) => number },
  ): BatchWrite<T> {
    const logs = this.#logs;
    const channels = this.#channels;
    this.clear();
    const targets: T[] = [];
    const appends: LogAppend[] = [];
    for (const [target, { pairs, workerId, final }] of logs) {
      targets.push(target);
      appends.push({
        requestId: target.requestId,
        attempt: target.attempt,
        maxEntries: options.maxEntries,
        ttlMs: options.ttlMs(target, final),
        workerId,
        pairs,
      });
    }
    const publishes: Publish[] = [];
    for (const [channel, entries] of channels) publishes.push({ channel, message: liveGatewayMessage(options.workerId, entries) });
    return { targets, channels: [...channels.keys()], written: scripts.writeEntries(appends, publishes) };
  }
}
