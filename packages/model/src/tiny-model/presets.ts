import type { TinyModelPreset } from '../types.js';

/** The architecture of a generated Llama model (the numbers that go into `config.json`). */
export interface LlamaArchitecture {
  vocabSize: number;
  /**
   * Tokens the BPE learns from the built-in corpus (specials and bytes included); the rest of
   * `vocabSize` is padding (`<|pad_N|>` tokens no text encodes to, near-zero embedding rows), as
   * real vocabularies are padded to a round size. @defaultValue vocabSize
   */
  learnedVocabSize?: number;
  hiddenSize: number;
  intermediateSize: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  maxPositionEmbeddings: number;
  rmsNormEps: number;
  ropeTheta: number;
}

/**
 * `tiny` keeps every test fast (a decode step is a fraction of a millisecond); `bench` is large
 * enough (~28M parameters) that a CPU decode step is dominated by model compute, not overhead;
 * `smollm2-135m` has the exact shapes of SmolLM2-135M (135M parameters, a 49152 vocabulary padded
 * from a learned 4096, 9 query / 3 KV heads), so benchmarks say what a real small model costs
 * (~540 MB of float32 weights: generated on demand, never by the build).
 */
export const TINY_MODEL_PRESETS: Readonly<Record<TinyModelPreset, LlamaArchitecture>> = {
  tiny: {
    vocabSize: 1024,
    hiddenSize: 64,
    intermediateSize: 176,
    numLayers: 2,
    numHeads: 4,
    numKvHeads: 2,
    headDim: 16,
    maxPositionEmbeddings: 2048,
    rmsNormEps: 1e-5,
    ropeTheta: 10000,
  },
  bench: {
    vocabSize: 4096,
    hiddenSize: 512,
    intermediateSize: 1408,
    numLayers: 8,
    numHeads: 8,
    numKvHeads: 4,
    headDim: 64,
    maxPositionEmbeddings: 2048,
    rmsNormEps: 1e-5,
    ropeTheta: 10000,
  },
  'smollm2-135m': {
    vocabSize: 49152,
    learnedVocabSize: 4096,
    hiddenSize: 576,
    intermediateSize: 1536,
    numLayers: 30,
    numHeads: 9,
    numKvHeads: 3,
    headDim: 64,
    maxPositionEmbeddings: 2048,
    rmsNormEps: 1e-5,
    ropeTheta: 100000,
  },
};

export function isTinyModelPreset(value: string): value is TinyModelPreset {
  return Object.hasOwn(TINY_MODEL_PRESETS, value);
}
