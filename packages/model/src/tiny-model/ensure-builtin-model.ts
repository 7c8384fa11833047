import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, readFile, rename, rm, stat } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { TinyModelPreset } from '../types.js';
import { GENERATOR_STAMP_FILE, generateTinyModel, generatorStamp, STAMPED_FILES } from './generate-tiny-model.js';

/**
 * Where built-in models live: `$SLUICE_MODELS_DIR`, else `<repo root>/models` (git-ignored). The
 * repository root is the nearest ancestor of this file whose package.json declares workspaces, so
 * the answer is the same from `src/` (tests) and `dist/` (apps).
 */
export function defaultModelsRoot(): string {
  const fromEnv = process.env.SLUICE_MODELS_DIR;
  if (fromEnv !== undefined && fromEnv !== '') return resolve(fromEnv);
  return join(findRepoRoot(), 'models');
}

function findRepoRoot(): string {
  const here = dirname(fileURLToPath(import.meta.url));
  for (let dir = here; ; dir = dirname(dir)) {
    const manifest = join(dir, 'package.json');
    if (existsSync(manifest)) {
      try {
        const parsed = JSON.parse(readFileSync(manifest, 'utf8')) as { workspaces?: unknown };
        if (parsed.workspaces !== undefined) return dir;
      } catch {
        // An unreadable package.json is not the root; keep walking up.
      }
    }
    if (dirname(dir) === dir) break;
  }
  // Not inside the monorepo (an installed copy): <package>/{src,dist}/tiny-model → <package>/../..
  return resolve(here, '..', '..', '..', '..');
}

type Found = 'current' | 'stale' | 'absent' | 'moving';

/**
 * What is at `dir` now. A current stamp counts only while every file it vouches for is there: a
 * directory that lost one (deleted, or copied without it) is stale and is generated again.
 * A directory that exists without a stamp is foreign (an error), and one with missing files stale,
 * only when the same directory (same inode) was there before and after the look: other callers
 * rename whole directories in and out, so between two separate checks the path can change hands,
 * and that is reported as `moving` (look again), never as foreign or stale.
 */
async function inspect(dir: string, preset: TinyModelPreset): Promise<Found> {
  const before = await unlessMissing(stat(dir));
  if (before === null) return 'absent';
  const stamp = await unlessMissing(readFile(join(dir, GENERATOR_STAMP_FILE), 'utf8'));
  if (stamp !== null && stamp !== generatorStamp(preset)) return 'stale';
  if (stamp !== null && (await hasStampedFiles(dir))) return 'current';
  const after = await unlessMissing(stat(dir));
  if (after === null || after.ino !== before.ino || after.dev !== before.dev) return 'moving';
  if (stamp !== null) return 'stale';
  throw new Error(`refusing to replace ${dir}: it has no ${GENERATOR_STAMP_FILE}, so the built-in generator did not write it`);
}

/** Whether every file the stamp vouches for is in `dir`, as a regular file. */
async function hasStampedFiles(dir: string): Promise<boolean> {
  for (const path of STAMPED_FILES) {
    const found = await unlessMissing(stat(join(dir, path)));
    if (found === null || !found.isFile()) return false;
  }
  return true;
}

/**
 * Returns `<root>/<preset>`, generating the built-in model there first when it is missing, was
 * written by another generator version, or lost one of its files. A directory there that the
 * generator did not write (no stamp file) is left alone and reported as an error.
 *
 * Safe with concurrent callers (parallel test processes): each generates into its own temporary
 * directory beside the target and renames it into place, so nobody ever sees a half-written model;
 * a caller that loses the race uses the winner's identical directory.
 */
export async function ensureBuiltinModel(preset: TinyModelPreset = 'tiny', root = defaultModelsRoot()): Promise<string> {
  const dir = join(root, preset);
  if ((await inspect(dir, preset)) === 'current') return dir;

  await mkdir(root, { recursive: true });
  const unique = `${process.pid}-${randomBytes(4).toString('hex')}`;
  const tmp = join(root, `.${preset}.tmp-${unique}`);
  try {
    await generateTinyModel({ preset, outDir: tmp });
    for (let attempt = 0; ; attempt++) {
      if (attempt > MAX_ATTEMPTS)
        throw new Error(`could not put the built-in model at ${dir}: it kept changing under ${MAX_ATTEMPTS} attempts`);
      const found = await inspect(dir, preset);
      if (found === 'current') return dir; // another process finished first
      if (found === 'moving') continue;
      if (found === 'stale') {
        // An older generator's model: move it aside, then delete it.
        const stale = join(root, `.${preset}.stale-${unique}-${attempt}`);
        try {
          await rename(dir, stale);
        } catch (error) {
          if (isRaceError(error)) continue;
          throw error;
        }
        await rm(stale, { recursive: true, force: true });
      }
      try {
        await rename(tmp, dir);
        return dir;
      } catch (error) {
        // Someone else renamed their copy into place between our look and our rename.
        if (!isRaceError(error)) throw error;
      }
    }
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
}

const MAX_ATTEMPTS = 20;

/** What the file operation gives, or null when the path (or a directory on it) does not exist. */
async function unlessMissing<T>(operation: Promise<T>): Promise<T | null> {
  try {
    return await operation;
  } catch (error) {
    if (isMissing(error)) return null;
    throw error;
  }
}

function isMissing(error: unknown): boolean {
  const code = (error as NodeJS.ErrnoException | undefined)?.code;
  return code === 'ENOENT' || code === 'ENOTDIR';
}

function isRaceError(error: unknown): boolean {
  const code = (error as NodeJS.ErrnoException | undefined)?.code;
  return code === 'ENOTEMPTY' || code === 'EEXIST' || code === 'ENOENT' || code === 'EPERM';
}
