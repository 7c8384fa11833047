import { spawnSync } from 'node:child_process';
import { mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { describeFsError } from '../src/cli/describe-fs-error.js';

/**
 * `npm run model:generate` where it cannot write: the real CLI, on places that refuse it. Tests run
 * as root, for whom permissions stop nothing: a path through a regular file does.
 */
const cli = fileURLToPath(new URL('../src/cli/generate-model.ts', import.meta.url));
const run = (args: string[], env: Record<string, string> = {}) =>
  spawnSync(process.execPath, ['--import', 'tsx', cli, '--preset', 'tiny', ...args], {
    encoding: 'utf8',
    timeout: 60_000,
    env: { ...process.env, ...env },
  });

let scratch: string;
let file: string;
beforeAll(async () => {
  scratch = await mkdtemp(join(tmpdir(), 'sluice-generate-fs-'));
  file = join(scratch, 'a-file');
  await writeFile(file, 'not a directory');
});
afterAll(async () => {
  await rm(scratch, { recursive: true, force: true });
});

describe('npm run model:generate where it cannot write', () => {
  it('names an output directory under a regular file and the cause in one line, and exits 1', () => {
    const result = run(['--out', join(file, 'model')]);
    expect(result.status).toBe(1);
    expect(result.stderr).toBe(
      `model:generate: cannot write ${join(file, 'model')}: part of that path is a file, not a directory (ENOTDIR)\n`,
    );
  });

  it('names an output directory that is a regular file', () => {
    const result = run(['--out', file]);
    expect(result.status).toBe(1);
    expect(result.stderr).toBe(`model:generate: cannot write ${file}: it is a file, not a directory (EEXIST)\n`);
  });

  it('names a GGUF path that is a directory, and leaves no partial file beside it', async () => {
    const dir = join(scratch, 'gguf-dir');
    await mkdir(dir);
    const result = run(['--format', 'gguf', '--out', dir]);
    expect(result.status).toBe(1);
    expect(result.stderr).toBe(`model:generate: cannot write ${dir}: it is a directory (EISDIR)\n`);
    expect((await readdir(scratch)).filter((name) => name.includes('partial'))).toEqual([]);
  });

  it('names the default copy it cannot make (SLUICE_MODELS_DIR under a regular file)', () => {
    const result = run([], { SLUICE_MODELS_DIR: join(file, 'models') });
    expect(result.status).toBe(1);
    expect(result.stderr).toMatch(new RegExp(`^model:generate: cannot write ${join(file, 'models')}\\S*: .*\\(ENOTDIR\\)\\n$`));
  });
});

describe('the line for a file-system error', () => {
  const errno = (code: string, syscall: string, fields: { path?: string; dest?: string } = {}) =>
    Object.assign(new Error(`${code}: something, ${syscall}`), { code, syscall, ...fields });

  it('names the path and says the cause in words, with its code', () => {
    expect(describeFsError(errno('ENOSPC', 'write', { path: '/m/onnx/model.onnx' }), '/m')).toBe(
      'cannot write /m/onnx/model.onnx: no space left on the device (ENOSPC)',
    );
    expect(describeFsError(errno('EROFS', 'open', { path: '/ro/config.json' }), '/ro')).toBe(
      'cannot write /ro/config.json: the file system is read-only (EROFS)',
    );
  });

  it('names the output when the error has no path (a write to an open file)', () => {
    expect(describeFsError(errno('ENOSPC', 'write'), '/out/model.gguf')).toBe(
      'cannot write /out/model.gguf: no space left on the device (ENOSPC)',
    );
  });

  it('names the destination of a rename, not the file written aside', () => {
    expect(describeFsError(errno('EISDIR', 'rename', { path: '/m.gguf.partial', dest: '/m.gguf' }), '/m.gguf')).toBe(
      'cannot write /m.gguf: it is a directory (EISDIR)',
    );
  });

  it('keeps the message of a code it has no words for, and leaves other errors alone', () => {
    expect(describeFsError(errno('EIO', 'write', { path: '/m' }), '/m')).toBe('cannot write /m: EIO: something, write (EIO)');
    expect(describeFsError(new Error('a bug'), '/m')).toBeUndefined();
    expect(describeFsError('text', '/m')).toBeUndefined();
  });
});
