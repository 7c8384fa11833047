/** Reasons of the file-system errors a generator meets, said for a person (the code follows in brackets). */
const REASONS: Record<string, string> = {
  ENOTDIR: 'part of that path is a file, not a directory',
  EEXIST: 'it is a file, not a directory',
  EISDIR: 'it is a directory',
  EACCES: 'permission denied',
  EPERM: 'operation not permitted',
  EROFS: 'the file system is read-only',
  ENOSPC: 'no space left on the device',
  EDQUOT: 'the disk quota is used up',
  ENAMETOOLONG: 'the name is too long',
  ENOENT: 'no such file or directory',
};

/**
 * One line naming the path and the cause of a file-system error (`cannot write <path>: <reason>
 * (<code>)`), or undefined for any other error, which keeps its stack: that one is a bug.
 * `fallbackPath` is named when the error carries no path (a write to an open file).
 */
export function describeFsError(error: unknown, fallbackPath: string): string | undefined {
  if (!(error instanceof Error)) return undefined;
  const { code, syscall, path, dest } = error as NodeJS.ErrnoException & { dest?: string };
  if (typeof code !== 'string' || typeof syscall !== 'string') return undefined;
  // A rename fails on its destination: the path the caller asked for, not the file written aside.
  const target = syscall === 'rename' ? (dest ?? path) : path;
  return `cannot write ${target ?? fallbackPath}: ${REASONS[code] ?? error.message} (${code})`;
}
