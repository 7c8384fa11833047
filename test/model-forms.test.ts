import { mkdtemp, rename, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { generateTinyModel, type GenerateTinyModelOptions } from '@sluice/model';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import { sleep, waitFor } from './support/processes.js';
import { checkChunkSequence, postRaw } from './support/sse.js';

/**
 * Model directories in the forms real exports come in are served end to end (gateway, Redis, worker,
 * engine) from the engine's own KV cache: the GroupQueryAttention form (onnxruntime's `com.microsoft`
 * op, as onnxruntime-genai's builder writes), and either form with its weights in `model.onnx_data`
 * beside a graph-only `model.onnx` (every export past protobuf's 2 GB), attention over `present.*` as
 * Optimum exports transformers' SDPA, and Optimum's merged decoder
 * (`onnx/decoder_model_merged.onnx`, one `If` on `use_cache_branch`) as transformers.js-era repos
 * ship it. The same weights in the
 * built-in plain form, served the same way, give the same text for the same requests, alone and
 * concurrently.
 */
const PROMPTS = [
  'Once upon a time',
  'The sea was calm and',
  'A small red fox',
  'Bread is made of',
  'Two old friends met',
  'Rain on a tin roof',
];

interface Served {
  concurrent: string[];
  alone: string;
  /** The worker's `worker ready` log line. */
  ready: { kvCache?: string; groupQueryAttention?: string; splitAttentionLayers?: number };
}

/** Texts of every prompt served by a worker on `modelDir`: streamed concurrently, then one alone (stream: false). */
async function serve(modelDir: string | undefined, env: Record<string, string> = {}): Promise<Served> {
  const cluster = await Cluster.start();
  try {
    const worker = await cluster.worker({
      MAX_BATCH_SIZE: '8',
      MODEL_ID: MODEL,
      LOG_LEVEL: 'info',
      ...(modelDir === undefined ? {} : { MODEL_DIR: modelDir }),
      ...env,
    });
    const ready = await waitFor('the worker ready line', async () => {
      const line = worker.process
        .output()
        .split('\n')
        .find((text) => text.includes('"worker ready"'));
      return line === undefined ? undefined : (JSON.parse(line) as Served['ready']);
    });
    const gateway = await cluster.gateway();
    const body = (prompt: string, maxTokens: number) => ({ model: MODEL, prompt, max_tokens: maxTokens, temperature: 0 });
    const concurrent = await Promise.all(
      PROMPTS.map(async (prompt, i) => {
        await sleep(i * 20);
        const res = await postRaw(`${gateway.url}/v1/completions`, { ...body(prompt, 24 + i * 9), stream: true });
        expect(res.status, cluster.logs()).toBe(200);
        return checkChunkSequence(res.items, 'completion', false).text;
      }),
    );
    const single = await postRaw(`${gateway.url}/v1/completions`, body(PROMPTS[0]!, 40));
    expect(single.status).toBe(200);
    const alone = (single.json as { choices: Array<{ text: string }> }).choices[0]!.text;
    return { concurrent, alone, ready };
  } finally {
    await cluster.stop();
  }
}

const FORMS: Array<
  { label: string; env?: Record<string, string>; onnxFile?: string } & Pick<
    GenerateTinyModelOptions,
    'attention' | 'externalData' | 'merged'
  >
> = [
  { label: 'the GroupQueryAttention form, run by the operator (GQA_ATTENTION=op)', attention: 'gqa', env: { GQA_ATTENTION: 'op' } },
  { label: 'the plain form with its weights in model.onnx_data', externalData: true },
  {
    label: 'the GroupQueryAttention form with its weights in model.onnx_data (decomposed into the plain form’s ops, the default)',
    attention: 'gqa',
    externalData: true,
  },
  {
    label: 'onnxruntime-genai’s CPU form (GroupQueryAttention rotating inside, q/k/v packed, no position_ids), run by the operator',
    attention: 'gqa-fused',
    env: { GQA_ATTENTION: 'op' },
  },
  {
    label: 'onnxruntime-genai’s CPU form, decomposed into the plain form’s attention ops (the default)',
    attention: 'gqa-fused',
  },
  { label: 'Optimum’s export of transformers’ SDPA attention (over present.*, repeat_kv)', attention: 'sdpa' },
  {
    label: 'Optimum’s merged decoder with that attention, as onnx/decoder_model_merged.onnx with no model.onnx',
    attention: 'sdpa',
    merged: true,
    onnxFile: 'decoder_model_merged.onnx',
  },
];

describe.skipIf(FAKE_ENGINE)('a model directory in another form', () => {
  let plain: Served;
  const dirs: string[] = [];

  beforeAll(async () => {
    plain = await serve(undefined);
  });

  afterAll(async () => {
    for (const dir of dirs) await rm(dir, { recursive: true, force: true });
  });

  it.each(FORMS.map((form) => [form.label, form] as const))(
    'in %s is served through gateway and worker from the engine-owned cache, with the plain form’s text',
    async (_, { label, env, onnxFile, ...layout }) => {
      const dir = await mkdtemp(join(tmpdir(), 'sluice-e2e-form-'));
      dirs.push(dir);
      await generateTinyModel({ preset: 'tiny', outDir: dir, ...layout });
      if (onnxFile !== undefined) await rename(join(dir, 'onnx', 'model.onnx'), join(dir, 'onnx', onnxFile));
      const served = await serve(dir, env);
      expect(plain.ready.kvCache).toBe('engine-owned');
      expect(served.ready.kvCache).toBe('engine-owned');
      expect(plain.ready.groupQueryAttention).toBe('none');
      expect(served.ready.groupQueryAttention).toBe(
        layout.attention === undefined || layout.attention === 'sdpa' ? 'none' : env?.['GQA_ATTENTION'] === 'op' ? 'op' : 'decomposed',
      );
      // Attention over present.* (Optimum's form) split in both layers of the tiny model; no other form has it.
      expect(plain.ready.splitAttentionLayers).toBe(0);
      expect(served.ready.splitAttentionLayers).toBe(layout.attention === 'sdpa' ? 2 : 0);
      expect(served.concurrent.every((text) => text.length > 0)).toBe(true);
      expect(served.concurrent).toEqual(plain.concurrent);
      expect(served.alone).toEqual(plain.alone);
    },
  );
});
