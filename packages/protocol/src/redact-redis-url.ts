/**
 * A Redis URL fit for a log line or an error message: its user and password replaced by `***`
 * (`redis://:secret@host:6379/0` → `redis://***@host:6379/0`). A URL without credentials is returned
 * as it is. Greedy up to the last `@`: a password with an unescaped `/` or `@` is hidden whole too.
 */
export function redactRedisUrl(url: string): string {
  return url.replace(/^([a-z][a-z\d+.-]*:\/\/).*@/i, '$1***@');
}
