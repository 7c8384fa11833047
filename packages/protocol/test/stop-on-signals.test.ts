import { EventEmitter } from 'node:events';
import { describe, expect, it } from 'vitest';
import { stopOnSignals, type SignalTarget, type StopLogger } from '../src/index.js';

/** Signals sent by hand and the exit codes asked for, in order; what was logged. */
function harness() {
  const emitter = new EventEmitter();
  const exits: number[] = [];
  const logged: Array<[string, string]> = [];
  const target: SignalTarget = { on: (signal, listener) => emitter.on(signal, listener), exit: (code) => void exits.push(code) };
  const logger: StopLogger = {
    info: (_fields, message) => void logged.push(['info', message]),
    warn: (_fields, message) => void logged.push(['warn', message]),
    error: (_fields, message) => void logged.push(['error', message]),
  };
  return { send: (signal: string) => emitter.emit(signal), exits, logged, target, logger };
}

/** A drain the test ends when it chooses. */
function heldDrain() {
  let settle!: { resolve: () => void; reject: (error: Error) => void };
  const promise = new Promise<void>((resolve, reject) => (settle = { resolve, reject }));
  let calls = 0;
  return {
    drain: () => {
      calls++;
      return promise;
    },
    settle,
    calls: () => calls,
  };
}

describe('stopping on SIGTERM or SIGINT', () => {
  for (const signal of ['SIGTERM', 'SIGINT']) {
    it(`${signal}: drains once, then exits 0`, async () => {
      const h = harness();
      const drain = heldDrain();
      stopOnSignals(h.logger, drain.drain, h.target);
      h.send(signal);
      expect(drain.calls()).toBe(1);
      await Promise.resolve();
      expect(h.exits).toEqual([]);
      drain.settle.resolve();
      await new Promise((resolve) => setImmediate(resolve));
      expect(h.exits).toEqual([0]);
      expect(h.logged).toEqual([['info', 'shutting down']]);
    });
  }

  it('exits 1 when the drain fails, and says why', async () => {
    const h = harness();
    const drain = heldDrain();
    stopOnSignals(h.logger, drain.drain, h.target);
    h.send('SIGTERM');
    drain.settle.reject(new Error('redis gone'));
    await new Promise((resolve) => setImmediate(resolve));
    expect(h.exits).toEqual([1]);
    expect(h.logged).toEqual([
      ['info', 'shutting down'],
      ['error', 'drain failed'],
    ]);
  });

  it('exits 1 at once on a second signal, without draining again', () => {
    const h = harness();
    const drain = heldDrain();
    stopOnSignals(h.logger, drain.drain, h.target);
    h.send('SIGTERM');
    h.send('SIGINT');
    expect(drain.calls()).toBe(1);
    expect(h.exits).toEqual([1]);
    expect(h.logged.at(-1)).toEqual(['warn', 'second signal: exiting now']);
  });
});
