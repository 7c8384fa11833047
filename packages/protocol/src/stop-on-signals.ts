/** What {@link stopOnSignals} logs through (a pino logger is one). */
export interface StopLogger {
  info(fields: object, message: string): void;
  warn(fields: object, message: string): void;
  error(fields: object, message: string): void;
}

/** Where the signals come from and how the process ends: `process`, or a stand-in in a test. */
export interface SignalTarget {
  on(signal: 'SIGTERM' | 'SIGINT', listener: () => void): unknown;
  exit(code: number): void;
}

/**
 * A gateway's or worker's shutdown: the first SIGTERM or SIGINT drains (exit 0 once drained, 1 if the
 * drain fails); a second one exits 1 at once, for an operator who will not wait.
 */
export function stopOnSignals(logger: StopLogger, drain: () => Promise<void>, target: SignalTarget = process): void {
  let stopping = false;
  const stop = (signal: string) => {
    if (stopping) {
      logger.warn({ signal }, 'second signal: exiting now');
      target.exit(1);
      return;
    }
    stopping = true;
    logger.info({ signal }, 'shutting down');
    drain().then(
      () => target.exit(0),
      (error: unknown) => {
        logger.error({ err: error }, 'drain failed');
        target.exit(1);
      },
    );
  };
  target.on('SIGTERM', () => stop('SIGTERM'));
  target.on('SIGINT', () => stop('SIGINT'));
}
