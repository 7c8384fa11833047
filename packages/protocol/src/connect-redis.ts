import type { Redis } from 'ioredis';

/**
 * Connects a process's Redis connections (created with `lazyConnect`), logging each one's errors by
 * name from now on. When they cannot all connect, disconnects them and rejects with the cause Redis
 * or the socket gave (ECONNREFUSED, WRONGPASS…) as a plain Error: `connect()` itself only says
 * "Connection is closed.", and an ioredis reply error holds its command, AUTH password included.
 */
export async function connectRedis(
  connections: ReadonlyArray<readonly [name: string, connection: Redis]>,
  warn: (err: string, connection: string) => void,
): Promise<void> {
  let cause: Error | undefined;
  for (const [name, connection] of connections) {
    connection.on('error', (err: Error) => {
      cause = err;
      warn(err.message, name);
    });
  }
  try {
    await Promise.all(connections.map(([, connection]) => connection.connect()));
  } catch (error) {
    for (const [, connection] of connections) connection.disconnect();
    throw new Error((cause ?? (error as Error)).message);
  }
}
