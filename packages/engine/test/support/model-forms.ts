import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ensureBuiltinModel, generateTinyModel, type AttentionForm } from '@sluice/model';

/** Both attention forms the generator writes, as real exports come in (Optimum's plain ops, onnxruntime-genai's GQA). */
export const ATTENTION_FORMS: readonly AttentionForm[] = ['plain', 'gqa'];

/**
 * The tiny model's directory in the given attention form: the built-in one for `plain`, a fresh
 * temporary generation (same weights and tokenizer) for `gqa`. `remove()` deletes what was made.
 */
export async function tinyModelDir(form: AttentionForm): Promise<{ dir: string; remove: () => Promise<void> }> {
  if (form === 'plain') return { dir: await ensureBuiltinModel('tiny'), remove: async () => {} };
  const dir = await mkdtemp(join(tmpdir(), `sluice-tiny-${form}-`));
  await generateTinyModel({ preset: 'tiny', outDir: dir, attention: form });
  return { dir, remove: () => rm(dir, { recursive: true, force: true }) };
}
