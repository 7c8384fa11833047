import { mkdir, open, rename, rm } from 'node:fs/promises';
import { dirname } from 'node:path';
import type { TinyModelPreset } from '../types.js';
import { encodeGguf, type GgufTensor, type GgufValue } from '../gguf/gguf-writer.js';
import { buildTinyModelParts, DEFAULT_SEED, GENERATOR_VERSION } from './generate-tiny-model.js';
import type { WeightTensor } from './llama-weights.js';
import { CHATML_TEMPLATE, SPECIAL_IDS, SPECIAL_TOKENS } from './tokenizer-files.js';

/** llama.cpp's token types (`llama_token_type`). */
const TOKEN_TYPE = { normal: 1, control: 3, unused: 5 } as const;

/**
 * Row `r` of a rotary projection in llama.cpp's layout comes from this row of the Hugging Face
 * layout. Hugging Face rotates the two halves of each head (`rotate_half`: dimension j pairs with
 * j + head_dim/2); llama.cpp's Llama rotates adjacent pairs (2j with 2j + 1). Interleaving each
 * head's halves in the query and key projections (the same order on both, so q·k is unchanged) makes
 * one the other.
 */
export function rotaryRowSource(row: number, headDim: number): number {
  const head = Math.floor(row / headDim);
  const within = row % headDim;
  return head * headDim + (within % 2) * (headDim / 2) + Math.floor(within / 2);
}

/**
 * A linear weight stored `[in, out]` (the ONNX MatMul operand) as the `[out, in]` matrix GGUF holds
 * (PyTorch's layout), its output rows optionally reordered.
 */
function outputRows(weight: WeightTensor, rowSource: (row: number) => number = (row) => row): Float32Array {
  const [inputs, outputs] = weight.dims as [number, number];
  const out = new Float32Array(inputs * outputs);
  for (let row = 0; row < outputs; row++) {
    const source = rowSource(row);
    for (let column = 0; column < inputs; column++) out[row * inputs + column] = weight.data[column * outputs + source] as number;
  }
  return out;
}

/**
 * The metadata and tensors of a generated model as llama.cpp's `llama` architecture: the same
 * weights as the ONNX model of that preset and seed (tied embeddings: no `output.weight`), its
 * byte-level BPE as a `gpt2` tokenizer with GPT-2's pre-tokenizer, and its ChatML template.
 */
export function buildTinyModelGguf(
  preset: TinyModelPreset,
  seed = DEFAULT_SEED,
): { metadata: Map<string, GgufValue>; tensors: GgufTensor[] } {
  const { architecture: arch, bpe, padIds, weights } = buildTinyModelParts(preset, seed);
  const { hiddenSize: d, numHeads: h, numKvHeads: kvh, headDim: hd } = arch;
  const weight = (name: string): WeightTensor => {
    const tensor = weights.get(name);
    if (tensor === undefined) throw new Error(`missing weight ${name}`);
    return tensor;
  };

  const tokens = [...SPECIAL_TOKENS, ...bpe.tokens];
  const pads = new Set(padIds);
  const tokenTypes = tokens.map((_, id) =>
    id < SPECIAL_TOKENS.length ? TOKEN_TYPE.control : pads.has(id) ? TOKEN_TYPE.unused : TOKEN_TYPE.normal,
  );
  const u32 = (value: number): GgufValue => ({ type: 'uint32', value });
  const f32 = (value: number): GgufValue => ({ type: 'float32', value });
  const metadata = new Map<string, GgufValue>([
    ['general.architecture', { type: 'string', value: 'llama' }],
    ['general.name', { type: 'string', value: `sluice-${preset}` }],
    [
      'general.description',
      { type: 'string', value: `@sluice/model generated model v${GENERATOR_VERSION}, preset ${preset}, seed ${seed}` },
    ],
    ['general.file_type', u32(0)], // all float32
    ['llama.vocab_size', u32(arch.vocabSize)],
    ['llama.context_length', u32(arch.maxPositionEmbeddings)],
    ['llama.embedding_length', u32(d)],
    ['llama.block_count', u32(arch.numLayers)],
    ['llama.feed_forward_length', u32(arch.intermediateSize)],
    ['llama.attention.head_count', u32(h)],
    ['llama.attention.head_count_kv', u32(kvh)],
    ['llama.attention.key_length', u32(hd)],
    ['llama.attention.value_length', u32(hd)],
    ['llama.attention.layer_norm_rms_epsilon', f32(arch.rmsNormEps)],
    ['llama.rope.freq_base', f32(arch.ropeTheta)],
    ['llama.rope.dimension_count', u32(hd)],
    ['tokenizer.ggml.model', { type: 'string', value: 'gpt2' }],
    ['tokenizer.ggml.pre', { type: 'string', value: 'gpt-2' }],
    ['tokenizer.ggml.tokens', { type: 'string[]', value: tokens }],
    ['tokenizer.ggml.token_type', { type: 'int32[]', value: tokenTypes }],
    ['tokenizer.ggml.merges', { type: 'string[]', value: bpe.merges.map(([left, right]) => `${left} ${right}`) }],
    ['tokenizer.ggml.bos_token_id', u32(SPECIAL_IDS.imStart)],
    ['tokenizer.ggml.eos_token_id', u32(SPECIAL_IDS.imEnd)],
    ['tokenizer.ggml.padding_token_id', u32(SPECIAL_IDS.endOfText)],
    ['tokenizer.ggml.add_bos_token', { type: 'bool', value: false }],
    ['tokenizer.ggml.add_eos_token', { type: 'bool', value: false }],
    ['tokenizer.chat_template', { type: 'string', value: CHATML_TEMPLATE }],
  ]);

  const embed = weight('model.embed_tokens.weight');
  const tensors: GgufTensor[] = [{ name: 'token_embd.weight', shape: [arch.vocabSize, d], data: embed.data }];
  const rotary = (row: number): number => rotaryRowSource(row, hd);
  for (let i = 0; i < arch.numLayers; i++) {
    const p = `model.layers.${i}`;
    const norm = (name: string): Float32Array => weight(name).data;
    tensors.push(
      { name: `blk.${i}.attn_norm.weight`, shape: [d], data: norm(`${p}.input_layernorm.weight`) },
      { name: `blk.${i}.attn_q.weight`, shape: [h * hd, d], data: outputRows(weight(`${p}.self_attn.q_proj.weight`), rotary) },
      { name: `blk.${i}.attn_k.weight`, shape: [kvh * hd, d], data: outputRows(weight(`${p}.self_attn.k_proj.weight`), rotary) },
      { name: `blk.${i}.attn_v.weight`, shape: [kvh * hd, d], data: outputRows(weight(`${p}.self_attn.v_proj.weight`)) },
      { name: `blk.${i}.attn_output.weight`, shape: [d, h * hd], data: outputRows(weight(`${p}.self_attn.o_proj.weight`)) },
      { name: `blk.${i}.ffn_norm.weight`, shape: [d], data: norm(`${p}.post_attention_layernorm.weight`) },
      { name: `blk.${i}.ffn_gate.weight`, shape: [arch.intermediateSize, d], data: outputRows(weight(`${p}.mlp.gate_proj.weight`)) },
      { name: `blk.${i}.ffn_up.weight`, shape: [arch.intermediateSize, d], data: outputRows(weight(`${p}.mlp.up_proj.weight`)) },
      { name: `blk.${i}.ffn_down.weight`, shape: [d, arch.intermediateSize], data: outputRows(weight(`${p}.mlp.down_proj.weight`)) },
    );
  }
  tensors.push({ name: 'output_norm.weight', shape: [d], data: weight('model.norm.weight').data });
  return { metadata, tensors };
}

/** Writes a generated model's GGUF file; it appears at `path` complete (written aside, then renamed). */
export async function writeTinyModelGguf(path: string, preset: TinyModelPreset, seed = DEFAULT_SEED): Promise<void> {
  const { metadata, tensors } = buildTinyModelGguf(preset, seed);
  await mkdir(dirname(path), { recursive: true });
  const partial = `${path}.partial`;
  const file = await open(partial, 'w');
  try {
    try {
      for (const chunk of encodeGguf(metadata, tensors)) await file.write(chunk);
    } finally {
      await file.close();
    }
    await rename(partial, path);
  } catch (error) {
    // Out of room, or `path` is a directory: leave nothing half-written behind.
    await rm(partial, { force: true });
    throw error;
  }
}
