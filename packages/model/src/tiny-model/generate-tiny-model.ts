import { mkdir, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import type { TinyModelPreset } from '../types.js';
import { trainByteLevelBpe, type ByteLevelBpe } from './bpe-trainer.js';
import { CORPUS } from './corpus.js';
import { withExternalData } from './external-data.js';
import { buildLlamaGraph, type AttentionForm } from './llama-graph.js';
import { asMergedDecoder } from './merged-decoder.js';
import { countParameters, initLlamaWeights, type LlamaWeights } from './llama-weights.js';
import { TINY_MODEL_PRESETS, type LlamaArchitecture } from './presets.js';
import { buildTokenizerFiles, SPECIAL_IDS, SPECIAL_TOKENS } from './tokenizer-files.js';

/**
 * Version of the generator's output. Bump it whenever the generated files change (weights, graph,
 * tokenizer, corpus, configs): {@link ensureBuiltinModel} regenerates directories stamped with
 * another version.
 */
export const GENERATOR_VERSION = 7;

/** Seed of the built-in models. */
export const DEFAULT_SEED = 42;

/** Name of the stamp file that marks a directory written by this generator. */
export const GENERATOR_STAMP_FILE = '.sluice-generator';

/** The files the stamp vouches for, by path relative to the model directory: written before it. */
export const STAMPED_FILES = [
  'config.json',
  'generation_config.json',
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'onnx/model.onnx',
] as const;

export interface GenerateTinyModelOptions {
  preset: TinyModelPreset;
  /** Directory to write; created when missing, files in it are overwritten. */
  outDir: string;
  /** Seed of the random weights. @defaultValue 42 */
  seed?: number;
  /** How the graph writes attention (see {@link AttentionForm}). @defaultValue 'plain' */
  attention?: AttentionForm;
  /**
   * Write the weights into `onnx/model.onnx_data` beside a graph-only `onnx/model.onnx`, as exports of
   * models past protobuf's 2 GB limit (and some smaller ones) come. @defaultValue false
   */
  externalData?: boolean;
  /**
   * Write the decoder as Optimum's merged decoder (`decoder_model_merged.onnx`'s layout, still at
   * `onnx/model.onnx`): one `If` on a `use_cache_branch` input (see {@link asMergedDecoder}). @defaultValue false
   */
  merged?: boolean;
}

/** Where the weights of the ONNX graph go when {@link GenerateTinyModelOptions.externalData} is set. */
export const EXTERNAL_DATA_FILE = 'model.onnx_data';

/** How a generated model's ONNX files are laid out (the options besides preset and seed). */
export type TinyModelLayout = Pick<GenerateTinyModelOptions, 'attention' | 'externalData' | 'merged'>;

/** The generated files, by path relative to the model directory, plus what they hold. */
export interface TinyModelFiles {
  files: Map<string, Uint8Array>;
  architecture: LlamaArchitecture;
  parameters: number;
}

/** The stamp written into every generated directory; equal stamps mean identical files. */
export function generatorStamp(preset: TinyModelPreset, seed = DEFAULT_SEED, layout: TinyModelLayout = {}): string {
  const form = (layout.attention ?? 'plain') === 'plain' ? {} : { attention: layout.attention };
  const external = layout.externalData === true ? { externalData: true } : {};
  const merged = layout.merged === true ? { merged: true } : {};
  return `${JSON.stringify({ generator: '@sluice/model tiny-model', version: GENERATOR_VERSION, preset, seed, ...form, ...external, ...merged })}\n`;
}

const json = (value: unknown): Uint8Array => new TextEncoder().encode(`${JSON.stringify(value, null, 2)}\n`);

/** Ids of the byte tokens for control bytes (except tab and newline) and non-ASCII bytes. */
function quietByteIds(): number[] {
  const ids: number[] = [];
  for (let byte = 0; byte < 256; byte++) {
    const quiet = (byte < 0x20 && byte !== 0x09 && byte !== 0x0a) || byte >= 0x7f;
    if (quiet) ids.push(SPECIAL_TOKENS.length + byte);
  }
  return ids;
}

/** What a generated model is made of, before it is written in any file format. */
export interface TinyModelParts {
  architecture: LlamaArchitecture;
  /** The learned BPE, its tokens followed by the padding tokens up to the vocabulary size. */
  bpe: ByteLevelBpe;
  /** Ids of the padding tokens (`<|pad_N|>`), after the learned ones. */
  padIds: number[];
  weights: LlamaWeights;
}

/** The tokenizer and weights of a preset and seed, deterministically. */
export function buildTinyModelParts(preset: TinyModelPreset, seed = DEFAULT_SEED): TinyModelParts {
  const arch = TINY_MODEL_PRESETS[preset];
  const learned = arch.learnedVocabSize ?? arch.vocabSize;
  const bpe = trainByteLevelBpe(CORPUS, learned - SPECIAL_TOKENS.length);
  // Padding tokens up to vocabSize: in the vocabulary (ids and logits line up) but no text encodes to them.
  const padIds = Array.from({ length: arch.vocabSize - learned }, (_, i) => learned + i);
  for (const id of padIds) bpe.tokens.push(`<|pad_${id}|>`);
  const weights = initLlamaWeights(arch, seed, {
    eos: SPECIAL_IDS.imEnd,
    quiet: [SPECIAL_IDS.endOfText, SPECIAL_IDS.imStart, ...quietByteIds(), ...padIds],
  });
  return { architecture: arch, bpe, padIds, weights };
}

/**
 * Builds every file of a generated model in memory, deterministically: the same preset and seed
 * give byte-identical files on every run.
 */
export function buildTinyModelFiles(preset: TinyModelPreset, seed = DEFAULT_SEED, layout: TinyModelLayout = {}): TinyModelFiles {
  const attention = layout.attention ?? 'plain';
  const { architecture: arch, bpe, weights } = buildTinyModelParts(preset, seed);
  const tokenizer = buildTokenizerFiles(bpe, arch.maxPositionEmbeddings);

  const config = {
    architectures: ['LlamaForCausalLM'],
    attention_bias: false,
    attention_dropout: 0,
    bos_token_id: SPECIAL_IDS.imStart,
    eos_token_id: SPECIAL_IDS.imEnd,
    pad_token_id: SPECIAL_IDS.endOfText,
    head_dim: arch.headDim,
    hidden_act: 'silu',
    hidden_size: arch.hiddenSize,
    initializer_range: 0.02,
    intermediate_size: arch.intermediateSize,
    max_position_embeddings: arch.maxPositionEmbeddings,
    mlp_bias: false,
    model_type: 'llama',
    num_attention_heads: arch.numHeads,
    num_hidden_layers: arch.numLayers,
    num_key_value_heads: arch.numKvHeads,
    pretraining_tp: 1,
    rms_norm_eps: arch.rmsNormEps,
    rope_scaling: null,
    rope_theta: arch.ropeTheta,
    tie_word_embeddings: true,
    torch_dtype: 'float32',
    transformers_version: '4.46.0',
    use_cache: true,
    vocab_size: arch.vocabSize,
  };
  const generationConfig = {
    bos_token_id: SPECIAL_IDS.imStart,
    eos_token_id: SPECIAL_IDS.imEnd,
    pad_token_id: SPECIAL_IDS.endOfText,
    transformers_version: '4.46.0',
  };
  const decoder = buildLlamaGraph(
    arch,
    weights,
    {
      producerName: '@sluice/model tiny-model',
      producerVersion: String(GENERATOR_VERSION),
      metadata: { preset, seed: String(seed), attention },
    },
    attention,
  );
  const graph = layout.merged === true ? asMergedDecoder(decoder) : decoder;
  const onnx = layout.externalData === true ? withExternalData(graph, EXTERNAL_DATA_FILE) : { onnx: graph, data: undefined };

  const stamped: Record<(typeof STAMPED_FILES)[number], Uint8Array> = {
    'config.json': json(config),
    'generation_config.json': json(generationConfig),
    'tokenizer.json': json(tokenizer.tokenizer),
    'tokenizer_config.json': json(tokenizer.tokenizerConfig),
    'special_tokens_map.json': json(tokenizer.specialTokensMap),
    'onnx/model.onnx': onnx.onnx,
  };
  const files = new Map<string, Uint8Array>([
    ...STAMPED_FILES.map((path) => [path, stamped[path]] as const),
    ...(onnx.data === undefined ? [] : [[`onnx/${EXTERNAL_DATA_FILE}`, onnx.data] as const]),
    [GENERATOR_STAMP_FILE, new TextEncoder().encode(generatorStamp(preset, seed, layout))],
  ]);
  return { files, architecture: arch, parameters: countParameters(weights) };
}

/**
 * Writes a complete Hugging Face / Optimum / transformers.js model directory: a random Llama
 * decoder (`onnx/model.onnx`, opset 17) with a byte-level BPE tokenizer learned from a built-in
 * English corpus and a ChatML chat template.
 */
export async function generateTinyModel(options: GenerateTinyModelOptions): Promise<void> {
  const { files } = buildTinyModelFiles(options.preset, options.seed ?? DEFAULT_SEED, options);
  await writeTinyModelFiles(files, options.outDir);
}

/** Writes files built by {@link buildTinyModelFiles}; the stamp goes last, once the rest is complete. */
export async function writeTinyModelFiles(files: Map<string, Uint8Array>, outDir: string): Promise<void> {
  const entries = [...files].sort(([a], [b]) => Number(a === GENERATOR_STAMP_FILE) - Number(b === GENERATOR_STAMP_FILE));
  for (const [path, bytes] of entries) {
    const target = join(outDir, path);
    await mkdir(dirname(target), { recursive: true });
    await writeFile(target, bytes);
  }
}
