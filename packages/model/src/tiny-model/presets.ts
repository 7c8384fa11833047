import type { TinyModelPreset } from '../types.js';

/** The architecture of a generated Llama model (the numbers that go into `config.json`). */
export interface LlamaArchitecture {
  vocabSize: number;
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
 * enough (~28M parameters) that a CPU decode step is dominated by model compute, not overhead.
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
};

export function isTinyModelPreset(value: string): value is TinyModelPreset {
  return Object.hasOwn(TINY_MODEL_PRESETS, value);
}
