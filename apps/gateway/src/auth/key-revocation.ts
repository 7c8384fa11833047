import type { Logger } from 'pino';
import { GatewayError } from '../errors.js';
import type { ApiKeyStore } from './api-key-store.js';

/** What the revocation needs of this gateway's sessions (the SessionManager). */
export interface KeyHolders {
  /** Hashes of the API keys that own an open session. */
  owners(): ReadonlySet<string>;
  /** Ends every open session of `owner` with `error` and stops its work. @returns how many ended */
  endOwner(owner: string, error: GatewayError): number;
}

/** What the revocation needs of the job queue: the key's detached requests, which no session holds. */
export interface DetachedRequests {
  /** Stops the detached requests (running or waiting) of `owner`. @returns how many */
  cancelDetachedOf(owner: string): Promise<number>;
}

/**
 * Ends this gateway's requests in flight of a revoked API key. Deleting the key refuses its next
 * request everywhere; the ones already running (streams and waiting JSON replies, up to the request
 * deadline) end here: a stream with an `invalid_api_key` error frame and `[DONE]`, a reply not yet
 * sent with a 401, and each one's work is cancelled on its worker as for any failed request. Its
 * detached requests (a client that left within its resume grace) are cancelled too: nobody may resume
 * them any more.
 *
 * `npm run keys -- revoke` announces the key's hash on the gateways' channel, so this happens at once.
 * Pub/sub is at-most-once (a subscriber reconnecting misses the message), and a request authenticated
 * just before the revoke may open its session just after the message went by: each registry poll (and
 * a reconnected subscriber) also checks the keys of the open sessions, one `HEXISTS` per distinct key
 * in one round trip, and ends those whose key is gone.
 */
export class KeyRevocation {
  readonly #store: Pick<ApiKeyStore, 'missing'>;
  readonly #sessions: KeyHolders;
  readonly #detached: DetachedRequests;
  readonly #logger: Logger;
  #checking = false;

  constructor(store: Pick<ApiKeyStore, 'missing'>, sessions: KeyHolders, detached: DetachedRequests, logger: Logger) {
    this.#store = store;
    this.#sessions = sessions;
    this.#detached = detached;
    this.#logger = logger;
  }

  /** The key with this hash was revoked: its sessions here end. */
  revoked(keyHash: string): void {
    const ended = this.#sessions.endOwner(
      keyHash,
      new GatewayError('invalid_api_key', { message: 'The API key of this request was revoked: the request was stopped.' }),
    );
    // The key's hash prefix, as `npm run keys -- list` shows it (the name is gone with the key).
    const sha256 = keyHash.slice(0, 12);
    if (ended > 0) this.#logger.warn({ sha256, ended }, 'API key revoked: its requests in flight ended');
    this.#detached.cancelDetachedOf(keyHash).then(
      (cancelled) => {
        if (cancelled > 0) this.#logger.warn({ sha256, cancelled }, 'API key revoked: its detached requests cancelled');
      },
      (error: unknown) => this.#logger.warn({ err: error, sha256 }, "cancelling a revoked key's detached requests failed"),
    );
  }

  /** Ends the sessions whose key is gone. Never rejects: a check that cannot read Redis ends nothing. */
  async check(): Promise<void> {
    if (this.#checking) return;
    const owners = [...this.#sessions.owners()];
    if (owners.length === 0) return;
    this.#checking = true;
    try {
      for (const hash of await this.#store.missing(owners)) this.revoked(hash);
    } catch (error) {
      this.#logger.warn({ err: error }, 'checking the keys of the requests in flight failed');
    } finally {
      this.#checking = false;
    }
  }
}
