/** The gateway must not start as configured (e.g. a public HOST without any key); the message says what to set. */
export class AccessConfigError extends Error {
  override name = 'AccessConfigError';
}
