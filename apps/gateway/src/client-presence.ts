import type { ServerResponse } from 'node:http';

/**
 * Whether a route's client is still there, watched from the handler's first line. Node emits `close`
 * once, and a listener added after it never runs: a client that leaves while a handler awaits (a body,
 * a tokenizer, Redis) is noticed only by a listener registered before the first await. What leaving
 * does depends on how far the handler got: it says so with {@link onLeave} as it goes.
 */
export class ClientPresence {
  #gone = false;
  #onLeave: () => void = () => {};

  constructor(res: ServerResponse) {
    res.once('close', () => {
      this.#gone = true;
      this.#onLeave();
    });
  }

  /** The client left (its connection closed). */
  get gone(): boolean {
    return this.#gone;
  }

  /** What to do when the client leaves from now on (replaces what was set before). */
  onLeave(handler: () => void): void {
    this.#onLeave = handler;
  }
}
