import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, readFile, rename, rm } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { TinyModelPreset } from '../types.js';
import { GENERATOR_STAMP_FILE, generateTinyModel, generatorStamp } from './generate-tiny-model.js';

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

async function isCurrent(dir: string, preset: TinyModelPreset): Promise<boolean> {
  try {
    return (await readFile(join(dir, GENERATOR_STAMP_FILE), 'utf8')) === generatorStamp(preset);
  } catch {
    return false;
  }
}

/**
 * Returns `<root>/<preset>`, generating the built-in model there first when it is missing or was
 * written by another generator version. A directory there that the generator did not write (no
 * stamp file) is left alone and reported as an error.
 *
 * Safe with concurrent callers (parallel test processes): each generates into its own temporary
 * directory beside the target and renames it into place, so nobody ever sees a half-written model;
 * a caller that loses the race uses the winner's identical directory.
 */
export async function ensureBuiltinModel(preset: TinyModelPreset = 'tiny', root = defaultModelsRoot()): Promise<string> {
  const dir = join(root, preset);
  if (await isCurrent(dir, preset)) return dir;
  assertGenerated(dir);

  await mkdir(root, { recursive: true });
  const unique = `${process.pid}-${randomBytes(4).toString('hex')}`;
  const tmp = join(root, `.${preset}.tmp-${unique}`);
  try {
    await generateTinyModel({ preset, outDir: tmp });
    for (let attempt = 0; ; attempt++) {
      if (await isCurrent(dir, preset)) return dir; // another process finished first
      if (existsSync(dir)) {
        assertGenerated(dir);
        // A stale model (older generator): move it aside, then delete it.
        const stale = join(root, `.${preset}.stale-${unique}-${attempt}`);
        try {
          await rename(dir, stale);
          await rm(stale, { recursive: true, force: true });
        } catch (error) {
          if (!isRaceError(error) || attempt > 5) throw error;
          continue;
        }
      }
      try {
        await rename(tmp, dir);
        return dir;
      } catch (error) {
        // Someone else renamed their copy into place between our check and our rename.
        if (!isRaceError(error) || attempt > 5) throw error;
      }
    }
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
}

/** Never delete what the generator did not write (a user's own model, say). */
function assertGenerated(dir: string): void {
  if (existsSync(dir) && !existsSync(join(dir, GENERATOR_STAMP_FILE))) {
    throw new Error(`refusing to replace ${dir}: it has no ${GENERATOR_STAMP_FILE}, so the built-in generator did not write it`);
  }
}

function isRaceError(error: unknown): boolean {
  const code = (error as NodeJS.ErrnoException | undefined)?.code;
  return code === 'ENOTEMPTY' || code === 'EEXIST' || code === 'ENOENT' || code === 'EPERM';
}
