/**
 * A step of the worker's start that failed. Its message is one line for whoever started the worker,
 * naming what failed and the setting behind it (`worker cannot reach Redis at …: …`); the cause keeps
 * the rest (stack, error code) for the JSON log.
 */
export class StartupError extends Error {
  override name = 'StartupError';

  constructor(what: string, cause: unknown) {
    super(`worker ${what}: ${oneLine(cause)}`, { cause });
  }
}

/** Runs one start step; a failure becomes a StartupError saying `what` failed (given the cause), unless it already is one. */
export async function startupStep<T>(what: string | ((cause: unknown) => string), run: () => Promise<T>): Promise<T> {
  try {
    return await run();
  } catch (cause) {
    if (cause instanceof StartupError) throw cause;
    throw new StartupError(typeof what === 'string' ? what : what(cause), cause);
  }
}

function oneLine(cause: unknown): string {
  const text = cause instanceof Error ? cause.message : String(cause);
  return text.trim().replace(/\s*\n\s*/g, ' ');
}
