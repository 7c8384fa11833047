import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { gguf } from '@huggingface/gguf';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { buildTinyModelParts } from '../src/tiny-model/generate-tiny-model.js';
import { rotaryRowSource, writeTinyModelGguf } from '../src/tiny-model/llama-gguf.js';
import { TINY_MODEL_PRESETS } from '../src/tiny-model/presets.js';
import { SPECIAL_TOKENS } from '../src/tiny-model/tokenizer-files.js';

/**
 * The GGUF export of a generated model (llama.cpp's format), read back by an independent reader
 * (`@huggingface/gguf`). That llama.cpp runs it and answers as Sluice does is checked by
 * `npm run bench:serve` with a llama-server binary (docs/benchmarks.md), which CI does not have.
 */
describe('GGUF export of a generated model', () => {
  const arch = TINY_MODEL_PRESETS.tiny;
  const parts = buildTinyModelParts('tiny');
  let dir: string;
  let path: string;
  let file: Buffer;
  let parsed: Awaited<ReturnType<typeof gguf>>;

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'sluice-gguf-'));
    path = join(dir, 'tiny.gguf');
    await writeTinyModelGguf(path, 'tiny');
    file = await readFile(path);
    parsed = await gguf(path, { allowLocalFile: true });
  });
  afterAll(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  /** A tensor's float32 values as stored in the file. */
  const tensorData = (name: string): Float32Array => {
    const info = parsed.tensorInfos.find((t) => t.name === name);
    if (info === undefined) throw new Error(`no tensor ${name}`);
    const count = info.shape.reduce((a, b) => a * Number(b), 1);
    const start = Number(parsed.tensorDataOffset + info.offset);
    return new Float32Array(file.buffer.slice(file.byteOffset + start, file.byteOffset + start + count * 4));
  };
  /** An ONNX-layout `[in, out]` weight as GGUF's `[out, in]` rows, row r taken from row source(r). */
  const rows = (name: string, source: (row: number) => number = (r) => r): Float32Array => {
    const w = parts.weights.get(name)!;
    const [inputs, outputs] = w.dims as [number, number];
    const out = new Float32Array(inputs * outputs);
    for (let r = 0; r < outputs; r++) for (let c = 0; c < inputs; c++) out[r * inputs + c] = w.data[c * outputs + source(r)]!;
    return out;
  };

  it('holds the llama architecture, the tokenizer and the chat template as llama.cpp reads them', () => {
    const m = parsed.metadata as Record<string, unknown>;
    expect(m.version).toBe(3);
    expect(m['general.architecture']).toBe('llama');
    expect(m['llama.embedding_length']).toBe(arch.hiddenSize);
    expect(m['llama.block_count']).toBe(arch.numLayers);
    expect(m['llama.feed_forward_length']).toBe(arch.intermediateSize);
    expect(m['llama.attention.head_count']).toBe(arch.numHeads);
    expect(m['llama.attention.head_count_kv']).toBe(arch.numKvHeads);
    expect(m['llama.rope.dimension_count']).toBe(arch.headDim);
    expect(m['llama.rope.freq_base']).toBe(arch.ropeTheta);
    expect(m['llama.attention.layer_norm_rms_epsilon']).toBeCloseTo(arch.rmsNormEps, 12);
    expect(m['llama.context_length']).toBe(arch.maxPositionEmbeddings);
    expect(m['tokenizer.ggml.model']).toBe('gpt2');
    expect(m['tokenizer.ggml.pre']).toBe('gpt-2');
    const tokens = m['tokenizer.ggml.tokens'] as string[];
    expect(tokens).toHaveLength(arch.vocabSize);
    expect(tokens.slice(0, 3)).toEqual([...SPECIAL_TOKENS]);
    expect(tokens.slice(3)).toEqual(parts.bpe.tokens);
    expect((m['tokenizer.ggml.token_type'] as number[]).slice(0, 4)).toEqual([3, 3, 3, 1]);
    expect(m['tokenizer.ggml.merges']).toEqual(parts.bpe.merges.map(([a, b]) => `${a} ${b}`));
    expect(m['tokenizer.ggml.eos_token_id']).toBe(2); // <|im_end|>, as generation_config.json says
    expect(m['tokenizer.ggml.add_bos_token']).toBe(false);
    expect(m['tokenizer.chat_template']).toContain('<|im_start|>');
  });

  it('holds every weight once, float32, aligned, innermost dimension first (tied embeddings: no output.weight)', () => {
    const names = parsed.tensorInfos.map((t) => t.name);
    expect(names).toHaveLength(2 + 9 * arch.numLayers);
    expect(names).not.toContain('output.weight');
    for (const info of parsed.tensorInfos) {
      expect(info.dtype).toBe(0);
      expect(Number(info.offset) % 32).toBe(0);
    }
    const shape = (name: string) => parsed.tensorInfos.find((t) => t.name === name)!.shape.map(Number);
    expect(shape('token_embd.weight')).toEqual([arch.hiddenSize, arch.vocabSize]);
    expect(shape('blk.1.attn_q.weight')).toEqual([arch.hiddenSize, arch.numHeads * arch.headDim]);
    expect(shape('blk.1.attn_k.weight')).toEqual([arch.hiddenSize, arch.numKvHeads * arch.headDim]);
    expect(shape('blk.1.ffn_down.weight')).toEqual([arch.intermediateSize, arch.hiddenSize]);
    expect(Number(parsed.tensorDataOffset) % 32).toBe(0);
  });

  it('stores the ONNX weights transposed to [out, in], with the query and key rows interleaved per head for llama.cpp’s rotary', () => {
    const hd = arch.headDim;
    expect(tensorData('token_embd.weight')).toEqual(parts.weights.get('model.embed_tokens.weight')!.data);
    expect(tensorData('blk.1.attn_norm.weight')).toEqual(parts.weights.get('model.layers.1.input_layernorm.weight')!.data);
    expect(tensorData('blk.1.attn_v.weight')).toEqual(rows('model.layers.1.self_attn.v_proj.weight'));
    expect(tensorData('blk.1.attn_output.weight')).toEqual(rows('model.layers.1.self_attn.o_proj.weight'));
    expect(tensorData('blk.1.ffn_gate.weight')).toEqual(rows('model.layers.1.mlp.gate_proj.weight'));
    expect(tensorData('blk.1.ffn_down.weight')).toEqual(rows('model.layers.1.mlp.down_proj.weight'));
    expect(tensorData('blk.0.attn_q.weight')).toEqual(rows('model.layers.0.self_attn.q_proj.weight', (r) => rotaryRowSource(r, hd)));
    expect(tensorData('blk.1.attn_k.weight')).toEqual(rows('model.layers.1.self_attn.k_proj.weight', (r) => rotaryRowSource(r, hd)));
    expect(tensorData('output_norm.weight')).toEqual(parts.weights.get('model.norm.weight')!.data);
  });

  it('the row order turns rotate-half rotary (Hugging Face) into adjacent-pair rotary (llama.cpp): same rotated vector, reordered', () => {
    const hd = 16;
    const heads = 3;
    const x = Array.from({ length: heads * hd }, (_, i) => Math.sin(i * 1.7) + 0.1 * i);
    const position = 37;
    const angle = (j: number) => position * 10000 ** ((-2 * j) / hd);
    // Hugging Face: dimension j pairs with j + hd/2.
    const halfRotated = x.map((_, r) => {
      const base = Math.floor(r / hd) * hd;
      const d = r % hd;
      const j = d % (hd / 2);
      const [a, b] = [x[base + j]!, x[base + j + hd / 2]!];
      return d < hd / 2 ? a * Math.cos(angle(j)) - b * Math.sin(angle(j)) : b * Math.cos(angle(j)) + a * Math.sin(angle(j));
    });
    // llama.cpp's Llama (rope type "normal"): dimension 2j pairs with 2j + 1, on the reordered rows.
    const reordered = x.map((_, r) => x[rotaryRowSource(r, hd)]!);
    const pairRotated = reordered.map((_, r) => {
      const base = Math.floor(r / hd) * hd;
      const d = r % hd;
      const j = Math.floor(d / 2);
      const [a, b] = [reordered[base + 2 * j]!, reordered[base + 2 * j + 1]!];
      return d % 2 === 0 ? a * Math.cos(angle(j)) - b * Math.sin(angle(j)) : b * Math.cos(angle(j)) + a * Math.sin(angle(j));
    });
    for (let r = 0; r < x.length; r++) expect(pairRotated[r]).toBeCloseTo(halfRotated[rotaryRowSource(r, hd)]!, 12);
  });
});
