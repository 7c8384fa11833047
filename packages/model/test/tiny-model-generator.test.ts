import { existsSync } from 'node:fs';
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdir, mkdtemp, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import onnxProto from 'onnx-proto';
import { GENERATOR_STAMP_FILE, generateTinyModel } from '../src/tiny-model/generate-tiny-model.js';
import { defaultModelsRoot, ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import { EXTERNAL_DATA_MIN_BYTES } from '../src/tiny-model/external-data.js';
import { RawOnnxModel } from './support/raw-greedy.js';

async function hashTree(dir: string): Promise<Record<string, string>> {
  const out: Record<string, string> = {};
  for (const entry of await readdir(dir, { recursive: true, withFileTypes: true })) {
    if (!entry.isFile()) continue;
    const path = join(entry.parentPath, entry.name);
    out[relative(dir, path)] = createHash('sha256')
      .update(await readFile(path))
      .digest('hex');
  }
  return out;
}

let scratch: string;
beforeAll(async () => {
  scratch = await mkdtemp(join(tmpdir(), 'sluice-tiny-model-'));
});
afterAll(async () => {
  await rm(scratch, { recursive: true, force: true });
});

describe('generateTinyModel', () => {
  it('writes byte-identical files on every run', async () => {
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'a') });
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'b') });
    const a = await hashTree(join(scratch, 'a'));
    expect(Object.keys(a).sort()).toEqual(
      [
        GENERATOR_STAMP_FILE,
        'config.json',
        'generation_config.json',
        'onnx/model.onnx',
        'special_tokens_map.json',
        'tokenizer.json',
        'tokenizer_config.json',
      ].sort(),
    );
    expect(await hashTree(join(scratch, 'b'))).toEqual(a);
  });

  it('gives other weights, and only other weights, for another seed', async () => {
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'seeded'), seed: 7 });
    const a = await hashTree(join(scratch, 'a'));
    const seeded = await hashTree(join(scratch, 'seeded'));
    expect(seeded['onnx/model.onnx']).not.toBe(a['onnx/model.onnx']);
    expect(seeded['tokenizer.json']).toBe(a['tokenizer.json']);
    expect(seeded['config.json']).toBe(a['config.json']);
  });

  it('with externalData, keeps the weights in onnx/model.onnx_data beside a graph-only model.onnx: the same model, byte-identical on every run', async () => {
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'external'), externalData: true });
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'external-again'), externalData: true });
    const files = await hashTree(join(scratch, 'external'));
    expect(await hashTree(join(scratch, 'external-again'))).toEqual(files);
    const inline = await hashTree(join(scratch, 'a'));
    expect(Object.keys(files).sort()).toEqual([...Object.keys(inline), 'onnx/model.onnx_data'].sort());
    for (const path of ['config.json', 'tokenizer.json', 'tokenizer_config.json']) expect(files[path]).toBe(inline[path]);

    const graph = onnxProto.onnx.ModelProto.decode(await readFile(join(scratch, 'external', 'onnx', 'model.onnx'))).graph!;
    const initializers = graph.initializer ?? [];
    const external = initializers.filter((tensor) => tensor.dataLocation === onnxProto.onnx.TensorProto.DataLocation.EXTERNAL);
    // Every weight matrix moved, small constants stayed; the data file holds exactly the moved bytes.
    expect(external.map((tensor) => tensor.name)).toContain('model.embed_tokens.weight');
    for (const tensor of initializers.filter((t) => !external.includes(t)))
      expect(tensor.rawData?.length ?? 0).toBeLessThan(EXTERNAL_DATA_MIN_BYTES);
    const length = (tensor: (typeof external)[number]) => Number(tensor.externalData?.find((entry) => entry.key === 'length')?.value);
    expect(external.reduce((sum, tensor) => sum + length(tensor), 0)).toBe(
      (await stat(join(scratch, 'external', 'onnx', 'model.onnx_data'))).size,
    );

    // onnxruntime reads the weights from the data file: the same greedy tokens as the inline model.
    const [a, b] = [await RawOnnxModel.load(join(scratch, 'a')), await RawOnnxModel.load(join(scratch, 'external'))];
    try {
      const prompts = [
        [5, 6, 7, 8],
        [40, 41],
      ];
      expect(await b.greedy(prompts, { maxNewTokens: 12 })).toEqual(await a.greedy(prompts, { maxNewTokens: 12 }));
    } finally {
      await a.release();
      await b.release();
    }
  });

  it('with attention gqa-fused, writes onnxruntime-genai’s CPU form: GroupQueryAttention on the packed projection, rotating inside from cos/sin tables, no position_ids input', async () => {
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'gqa'), attention: 'gqa' });
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'gqa-fused'), attention: 'gqa-fused' });
    const model = onnxProto.onnx.ModelProto.decode(await readFile(join(scratch, 'gqa-fused', 'onnx', 'model.onnx')));
    const graph = model.graph!;
    expect((graph.input ?? []).map((input) => input.name)).not.toContain('position_ids');
    const attention = (graph.node ?? []).filter((node) => node.opType === 'GroupQueryAttention');
    expect(attention).toHaveLength(2);
    for (const node of attention) {
      expect(node.domain).toBe('com.microsoft');
      expect(node.input?.slice(1, 3)).toEqual(['', '']); // q/k/v packed into the first input
      expect(node.input?.slice(7)).toEqual(['cos_cache', 'sin_cache']);
      expect(Number(node.attribute?.find((entry) => entry.name === 'do_rotary')?.i)).toBe(1);
    }
    const config = JSON.parse(await readFile(join(scratch, 'gqa-fused', 'config.json'), 'utf8')) as Record<string, number>;
    const cos = graph.initializer?.find((tensor) => tensor.name === 'cos_cache');
    expect(cos?.dims?.map(Number)).toEqual([config['max_position_embeddings'], config['head_dim']! / 2]);

    // The same model as the gqa form (rotary computed by another routine: equal to float32 rounding).
    const [gqa, fused] = [await RawOnnxModel.load(join(scratch, 'gqa')), await RawOnnxModel.load(join(scratch, 'gqa-fused'))];
    try {
      const prompt = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]];
      const positions = [prompt[0]!.map((_, i) => i)];
      const mask = [prompt[0]!.map(() => 1)];
      const [a, b] = [
        await gqa.forward(prompt, mask, positions, gqa.emptyCache(1)),
        await fused.forward(prompt, mask, positions, fused.emptyCache(1)),
      ];
      const [x, y] = [a.logits.data as Float32Array, b.logits.data as Float32Array];
      expect(y.length).toBe(x.length);
      let diff = 0;
      for (let i = 0; i < x.length; i++) diff = Math.max(diff, Math.abs(x[i]! - y[i]!));
      expect(diff).toBeLessThan(1e-4);
    } finally {
      await gqa.release();
      await fused.release();
    }
  });

  it('with attention sdpa, writes attention over present.* as torch exports transformers’ SDPA (repeat_kv Expand, √scale on queries and keys), with the plain form’s greedy tokens', async () => {
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'sdpa'), attention: 'sdpa' });
    const graph = onnxProto.onnx.ModelProto.decode(await readFile(join(scratch, 'sdpa', 'onnx', 'model.onnx'))).graph!;
    const count = (opType: string) => (graph.node ?? []).filter((node) => node.opType === opType).length;
    expect(count('Expand')).toBe(4); // key and value of 2 layers
    expect(count('Softmax')).toBe(2);
    const present = (graph.node ?? []).find((node) => node.output?.[0] === 'present.0.key')!;
    expect(present.opType).toBe('Concat');
    // The present Concat feeds the attention (through repeat_kv), not only the graph output.
    expect((graph.node ?? []).some((node) => node.opType === 'Unsqueeze' && node.input?.[0] === 'present.0.key')).toBe(true);

    const [plain, sdpa] = [await RawOnnxModel.load(await ensureBuiltinModel('tiny')), await RawOnnxModel.load(join(scratch, 'sdpa'))];
    try {
      const prompts = [
        [5, 6, 7, 8, 9, 10, 11],
        [40, 41, 42],
      ];
      expect(await sdpa.greedy(prompts, { maxNewTokens: 24 })).toEqual(await plain.greedy(prompts, { maxNewTokens: 24 }));
    } finally {
      await plain.release();
      await sdpa.release();
    }
  });

  it('with merged, writes Optimum’s merged decoder: one If on use_cache_branch around the decoder, weights outside it, the plain decoder’s logits either way', async () => {
    await generateTinyModel({ preset: 'tiny', outDir: join(scratch, 'merged'), merged: true });
    const graph = onnxProto.onnx.ModelProto.decode(await readFile(join(scratch, 'merged', 'onnx', 'model.onnx'))).graph!;
    expect((graph.node ?? []).map((node) => node.opType)).toEqual(['If']);
    const [node] = graph.node!;
    expect(node!.input).toEqual(['use_cache_branch']);
    expect(node!.output).toEqual((graph.output ?? []).map((output) => output.name));
    const branches = Object.fromEntries((node!.attribute ?? []).map((entry) => [entry.name, entry.g!]));
    expect(Object.keys(branches)).toEqual(['then_branch', 'else_branch']);
    expect(branches['then_branch']!.name).toBe('with_past');
    expect(branches['else_branch']!.name).toBe('no_past');
    // Weights in the outer graph, scalars and int64 vectors in each branch (as Optimum's merge keeps them).
    expect((graph.initializer ?? []).map((tensor) => tensor.name)).toContain('model.embed_tokens.weight');
    for (const tensor of branches['then_branch']!.initializer ?? []) expect((tensor.dims ?? []).length).toBeLessThanOrEqual(1);
    expect((graph.input ?? []).at(-1)?.name).toBe('use_cache_branch');

    // The plain decoder's logits: its no-past branch on the prompt, its with-past branch on the next token.
    const [plain, merged] = [await RawOnnxModel.load(await ensureBuiltinModel('tiny')), await RawOnnxModel.load(join(scratch, 'merged'))];
    try {
      const prompt = [[5, 6, 7, 8, 9, 10, 11]];
      const [first, again] = [
        await plain.forward(prompt, [prompt[0]!.map(() => 1)], [prompt[0]!.map((_, i) => i)], plain.emptyCache(1)),
        await merged.forward(prompt, [prompt[0]!.map(() => 1)], [prompt[0]!.map((_, i) => i)], merged.emptyCache(1)),
      ];
      expect(again.logits.data).toEqual(first.logits.data);
      const next = [[12]];
      const mask = [Array<number>(8).fill(1)];
      const [second, secondAgain] = [
        await plain.forward(next, mask, [[7]], first.present),
        await merged.forward(next, mask, [[7]], again.present),
      ];
      expect(secondAgain.logits.data).toEqual(second.logits.data);
    } finally {
      await plain.release();
      await merged.release();
    }
  });

  it('writes a Llama config that matches the tokenizer', async () => {
    const dir = join(scratch, 'a');
    const config = JSON.parse(await readFile(join(dir, 'config.json'), 'utf8')) as Record<string, unknown>;
    const tokenizer = JSON.parse(await readFile(join(dir, 'tokenizer.json'), 'utf8')) as {
      model: { vocab: Record<string, number> };
    };
    expect(config).toMatchObject({
      model_type: 'llama',
      architectures: ['LlamaForCausalLM'],
      hidden_size: 64,
      num_hidden_layers: 2,
      num_attention_heads: 4,
      num_key_value_heads: 2,
      head_dim: 16,
      max_position_embeddings: 2048,
      tie_word_embeddings: true,
      torch_dtype: 'float32',
      eos_token_id: 2,
    });
    expect(Object.keys(tokenizer.model.vocab)).toHaveLength(config.vocab_size as number);
  });
});

describe('ensureBuiltinModel', () => {
  it('generates a missing model once and then reuses it', async () => {
    const root = join(scratch, 'root');
    const dir = await ensureBuiltinModel('tiny', root);
    expect(dir).toBe(join(root, 'tiny'));
    const before = (await stat(join(dir, 'onnx', 'model.onnx'))).mtimeMs;
    expect(await ensureBuiltinModel('tiny', root)).toBe(dir);
    expect((await stat(join(dir, 'onnx', 'model.onnx'))).mtimeMs).toBe(before);
    expect(await hashTree(dir)).toEqual(await hashTree(join(scratch, 'a')));
  });

  it('regenerates a model stamped by another generator version', async () => {
    const root = join(scratch, 'root');
    const dir = join(root, 'tiny');
    await writeFile(join(dir, GENERATOR_STAMP_FILE), '{"version":0}\n');
    await writeFile(join(dir, 'leftover.txt'), 'from an old generator');
    expect(await ensureBuiltinModel('tiny', root)).toBe(dir);
    expect(await hashTree(dir)).toEqual(await hashTree(join(scratch, 'a')));
  });

  it('refuses to replace a directory the generator did not write', async () => {
    const root = join(scratch, 'foreign');
    await mkdir(join(root, 'tiny'), { recursive: true });
    await writeFile(join(root, 'tiny', 'config.json'), '{}');
    await expect(ensureBuiltinModel('tiny', root)).rejects.toThrow(/refusing to replace .*\.sluice-generator/);
    expect(await readFile(join(root, 'tiny', 'config.json'), 'utf8')).toBe('{}');
    expect(await readdir(root)).toEqual(['tiny']);
  });

  it('lets concurrent callers share one complete directory', async () => {
    const root = join(scratch, 'concurrent');
    const dirs = await Promise.all([ensureBuiltinModel('tiny', root), ensureBuiltinModel('tiny', root), ensureBuiltinModel('tiny', root)]);
    expect(new Set(dirs)).toEqual(new Set([join(root, 'tiny')]));
    expect(await hashTree(join(root, 'tiny'))).toEqual(await hashTree(join(scratch, 'a')));
    expect((await readdir(root)).filter((name) => name.startsWith('.'))).toEqual([]);
  });

  it('lets many concurrent callers replace one stale model without taking it for a foreign one', async () => {
    // Callers that look while another renames a directory in or out must look again, not fail.
    for (let round = 0; round < 3; round++) {
      const root = join(scratch, `stale-race-${round}`);
      await mkdir(join(root, 'tiny'), { recursive: true });
      await writeFile(join(root, 'tiny', GENERATOR_STAMP_FILE), '{"version":0}\n');
      const dirs = await Promise.all(Array.from({ length: 6 }, () => ensureBuiltinModel('tiny', root)));
      expect(new Set(dirs)).toEqual(new Set([join(root, 'tiny')]));
      expect(await hashTree(join(root, 'tiny'))).toEqual(await hashTree(join(scratch, 'a')));
      expect((await readdir(root)).filter((name) => name.startsWith('.'))).toEqual([]);
    }
  });

  it('puts models under SLUICE_MODELS_DIR when it is set, else under <repo>/models', () => {
    const saved = process.env.SLUICE_MODELS_DIR;
    try {
      process.env.SLUICE_MODELS_DIR = join(scratch, 'env-root');
      expect(defaultModelsRoot()).toBe(join(scratch, 'env-root'));
      delete process.env.SLUICE_MODELS_DIR;
      expect(defaultModelsRoot()).toBe(fileURLToPath(new URL('../../../models', import.meta.url)));
    } finally {
      if (saved === undefined) delete process.env.SLUICE_MODELS_DIR;
      else process.env.SLUICE_MODELS_DIR = saved;
    }
  });
});

describe('npm run model:generate', () => {
  const cli = fileURLToPath(new URL('../src/cli/generate-model.ts', import.meta.url));
  const run = (...args: string[]) => spawnSync(process.execPath, ['--import', 'tsx', cli, ...args], { encoding: 'utf8', timeout: 60_000 });

  it('writes the preset it is asked for into --out', async () => {
    const out = join(scratch, 'cli');
    const result = run('--preset', 'tiny', '--out', out);
    expect(result.stderr).toBe('');
    expect(result.status).toBe(0);
    expect(result.stdout).toMatch(/Wrote the tiny model to .* parameters/);
    expect(await hashTree(out)).toEqual(await hashTree(join(scratch, 'a')));
  });

  it('without --out, makes sure the default copy exists and says where it is', () => {
    const result = spawnSync(process.execPath, ['--import', 'tsx', cli, '--preset', 'tiny'], {
      encoding: 'utf8',
      timeout: 60_000,
      env: { ...process.env, SLUICE_MODELS_DIR: join(scratch, 'default-models') },
    });
    expect(result.status).toBe(0);
    expect(result.stdout).toContain(`The built-in tiny model is at ${join(scratch, 'default-models', 'tiny')}`);
    expect(existsSync(join(scratch, 'default-models', 'tiny', 'onnx', 'model.onnx'))).toBe(true);
  });

  it('names the flag that is wrong', () => {
    const unknownPreset = run('--preset', 'huge', '--out', join(scratch, 'x'));
    expect(unknownPreset.status).toBe(2);
    expect(unknownPreset.stderr).toContain('--preset must be one of: tiny, bench, smollm2-135m (got "huge")');
    const badForm = run('--preset', 'tiny', '--out', join(scratch, 'x'), '--attention', 'flash');
    expect(badForm.stderr).toContain('--attention must be plain, gqa, gqa-fused or sdpa (got "flash")');
    const emptyOut = run('--preset', 'tiny', '--out', '');
    expect(emptyOut.status).toBe(2);
    expect(emptyOut.stderr).toContain('--out must name the directory');
    const seedWithoutOut = run('--preset', 'tiny', '--seed', '3');
    expect(seedWithoutOut.status).toBe(2);
    expect(seedWithoutOut.stderr).toContain('--seed needs --out');
    const badSeed = run('--preset', 'tiny', '--out', join(scratch, 'x'), '--seed', '-1');
    expect(badSeed.status).toBe(2);
    expect(badSeed.stderr).toContain('--seed');
    const externalWithoutOut = run('--preset', 'tiny', '--external-data');
    expect(externalWithoutOut.status).toBe(2);
    expect(externalWithoutOut.stderr).toContain('--external-data needs --out');
    const externalGguf = run('--preset', 'tiny', '--format', 'gguf', '--out', join(scratch, 'x.gguf'), '--external-data');
    expect(externalGguf.status).toBe(2);
    expect(externalGguf.stderr).toContain('--external-data is for the ONNX files');
    const mergedWithoutOut = run('--preset', 'tiny', '--merged');
    expect(mergedWithoutOut.status).toBe(2);
    expect(mergedWithoutOut.stderr).toContain('--merged needs --out');
  });

  it.each([
    ['Optimum’s merged decoder', '--merged', 'plain attention, merged decoder', 'merged'],
    ['the weights into model.onnx_data', '--external-data', 'onnx/model.onnx + model.onnx_data', 'external'],
  ])('writes %s with %s, the files generateTinyModel writes', async (_, flag, summary, generated) => {
    const out = join(scratch, `cli${flag}`);
    const result = run('--preset', 'tiny', '--out', out, flag);
    expect(result.stderr).toBe('');
    expect(result.status).toBe(0);
    expect(result.stdout).toContain(summary);
    expect(await hashTree(out)).toEqual(await hashTree(join(scratch, generated)));
  });
});
