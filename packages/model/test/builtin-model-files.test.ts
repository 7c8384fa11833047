import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readdir, rm, stat, unlink } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import { GENERATOR_STAMP_FILE, STAMPED_FILES } from '../src/tiny-model/generate-tiny-model.js';

/** The built-in model's stamp vouches for its files only while they are there (real directories). */
let root: string;
let dir: string;
beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'sluice-builtin-files-'));
  dir = await ensureBuiltinModel('tiny', root);
});
afterAll(async () => {
  await rm(root, { recursive: true, force: true });
});

describe('a built-in model directory whose stamp outlived a file', () => {
  it('is generated again when onnx/model.onnx is missing', async () => {
    await unlink(join(dir, 'onnx', 'model.onnx'));
    expect(existsSync(join(dir, GENERATOR_STAMP_FILE))).toBe(true);
    expect(await ensureBuiltinModel('tiny', root)).toBe(dir);
    expect((await stat(join(dir, 'onnx', 'model.onnx'))).size).toBeGreaterThan(0);
    expect((await readdir(root)).filter((name) => name.startsWith('.'))).toEqual([]);
  });

  it('is generated again when any other file it stamps is missing', async () => {
    for (const path of STAMPED_FILES) {
      await unlink(join(dir, path));
      expect(await ensureBuiltinModel('tiny', root), path).toBe(dir);
      expect(existsSync(join(dir, path)), path).toBe(true);
    }
  });

  it('is generated again when a stamped file is a directory in its place', async () => {
    await rm(join(dir, 'tokenizer.json'));
    await mkdir(join(dir, 'tokenizer.json'));
    expect(await ensureBuiltinModel('tiny', root)).toBe(dir);
    expect((await stat(join(dir, 'tokenizer.json'))).isFile()).toBe(true);
  });

  it('is used as it is while every stamped file is there', async () => {
    const before = (await stat(join(dir, 'onnx', 'model.onnx'))).mtimeMs;
    expect(await ensureBuiltinModel('tiny', root)).toBe(dir);
    expect((await stat(join(dir, 'onnx', 'model.onnx'))).mtimeMs).toBe(before);
  });
});
