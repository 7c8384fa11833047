import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ensureBuiltinModel, generateTinyModel, type AttentionForm } from '@sluice/model';
import type { GqaAttention } from '../../src/types.js';

/**
 * The attention forms the generator writes, as real exports come in: plain ops (the generator's own,
 * and `sdpa`, attending over `present.*` as Optimum's exports of transformers do), and onnxruntime's
 * GroupQueryAttention with rotary before it or inside it (q/k/v packed: what onnxruntime-genai's model
 * builder writes for CPU).
 */
export const ATTENTION_FORMS: readonly AttentionForm[] = ['plain', 'sdpa', 'gqa', 'gqa-fused'];

/** Whether the form runs onnxruntime's GroupQueryAttention operator. */
export const usesGroupQueryAttention = (attention: AttentionForm): boolean => attention === 'gqa' || attention === 'gqa-fused';

/** How a generated model's files come: its attention form, and its weights inside the graph file or in `model.onnx_data`. */
export interface ModelForm {
  attention: AttentionForm;
  externalData: boolean;
  /** How the engine runs GroupQueryAttention (EngineOptions.gqaAttention: 'op' where unset, so each form runs the operator unless it says). */
  gqaAttention?: GqaAttention;
  /** The decoder inside an `If` on `use_cache_branch`, as Optimum's `decoder_model_merged.onnx` lays it out. */
  merged?: boolean;
}

/** Each attention form with its weights in the graph file and in an external-data file (as large exports come). */
export const MODEL_FORMS: ReadonlyArray<ModelForm & { label: string }> = [
  ...ATTENTION_FORMS.flatMap((attention) => [
    { attention, externalData: false, label: attention },
    { attention, externalData: true, label: `${attention}, weights in model.onnx_data` },
  ]),
  // The GroupQueryAttention forms with the operator replaced by the plain form's ops (gqaAttention: 'decomposed').
  ...(['gqa', 'gqa-fused'] as const).map((attention) => ({
    attention,
    externalData: false,
    gqaAttention: 'decomposed' as const,
    label: `${attention}, decomposed`,
  })),
  // Optimum's merged decoders (transformers.js-era repos), with the weights inside and outside the graph file.
  { attention: 'plain', externalData: false, merged: true, label: 'plain, merged decoder' },
  { attention: 'sdpa', externalData: true, merged: true, label: 'sdpa, merged decoder, weights in model.onnx_data' },
  { attention: 'gqa', externalData: false, merged: true, label: 'gqa, merged decoder' },
];

/**
 * The tiny model's directory in the given form: the built-in one for the plain form with its weights
 * inside, else a fresh temporary generation (same weights and tokenizer). `remove()` deletes what was made.
 */
export async function tinyModelDir(form: AttentionForm | ModelForm): Promise<{ dir: string; remove: () => Promise<void> }> {
  const { attention, externalData, merged = false } = typeof form === 'string' ? { attention: form, externalData: false } : form;
  if (attention === 'plain' && !externalData && !merged) return { dir: await ensureBuiltinModel('tiny'), remove: async () => {} };
  const dir = await mkdtemp(join(tmpdir(), `sluice-tiny-${attention}${externalData ? '-external' : ''}${merged ? '-merged' : ''}-`));
  await generateTinyModel({ preset: 'tiny', outDir: dir, attention, externalData, merged });
  return { dir, remove: () => rm(dir, { recursive: true, force: true }) };
}
