import { Prng } from './prng.js';
import type { LlamaArchitecture } from './presets.js';

/** One weight tensor. Linear weights are stored `[in, out]` (the ONNX MatMul right operand). */
export interface WeightTensor {
  data: Float32Array;
  dims: number[];
}

/** Weights by their Hugging Face parameter name, plus `model.rotary_emb.inv_freq`. */
export type LlamaWeights = Map<string, WeightTensor>;

/** Token ids whose embedding rows get special scales (see {@link initLlamaWeights}). */
export interface SpecialTokenIds {
  eos: number;
  /**
   * Tokens the model should (almost) never emit: `<|im_start|>`, `<|endoftext|>`, control bytes and
   * lone non-ASCII bytes (a fragment of a UTF-8 character shows up as U+FFFD in the text).
   */
  quiet: readonly number[];
}

/**
 * Scales of the random init. The model is random, but its greedy output must be robust: the
 * engine proves that batched greedy tokens equal single-request greedy tokens, and near-ties flip
 * under float reordering. So the final norm scales the logits up (logits of ±15, median top-1
 * margin ≈ 1, below 1e-3 on ~0.1% of greedy steps, while batched-vs-single float32 differences
 * stay under 3e-5), the embedding is small next to the layer outputs (otherwise the residual stream
 * keeps the input token and the model repeats it), and EOS gets a row norm that makes it a rare but
 * possible argmax (~2% of greedy steps).
 */
export const INIT = {
  embeddingStd: 0.05,
  /** Gain on 1/sqrt(fan_in) of the attention and MLP projections. */
  projectionGain: 1.0,
  /** Gain of the output projections (o_proj, down_proj), which write into the residual stream. */
  residualGain: 2.0,
  /** Multiplier of the final RMSNorm weight: sets the logit scale. */
  logitScale: 15.0,
  /**
   * Strength of the anti-repetition head group (layer 0, KV head 0): it attends uniformly to the
   * context and subtracts the context's embeddings, so tokens already frequent in the context lose
   * logit and greedy decoding does not lock into one repeated token.
   */
  antiRepeatGain: 8.0,
  eosRowScale: 1.8,
  quietRowScale: 0.1,
} as const;

/** Uniform [-a, a) with standard deviation `std` (a = std·√3): only exact arithmetic on the PRNG. */
function uniform(rng: Prng, count: number, std: number): Float32Array {
  const a = std * Math.sqrt(3);
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) out[i] = rng.nextSigned() * a;
  return out;
}

/** RMSNorm weights around `center` (not exactly 1, so a graph that ignores them fails its check). */
function normWeight(rng: Prng, size: number, center: number): Float32Array {
  const out = new Float32Array(size);
  for (let i = 0; i < size; i++) out[i] = center * (1 + 0.2 * rng.nextSigned());
  return out;
}

/** `theta^(-2j/head_dim)`, computed in float64 and rounded once. */
export function rotaryInvFreq(arch: LlamaArchitecture): Float32Array {
  const half = arch.headDim / 2;
  const out = new Float32Array(half);
  for (let j = 0; j < half; j++) out[j] = 1 / arch.ropeTheta ** ((2 * j) / arch.headDim);
  return out;
}

/** Deterministic random weights of a Llama model with tied embeddings. */
export function initLlamaWeights(arch: LlamaArchitecture, seed: number, special: SpecialTokenIds): LlamaWeights {
  const weights: LlamaWeights = new Map();
  const rng = (name: string): Prng => Prng.forKey(seed, name);
  const { hiddenSize: d, intermediateSize: inter, numHeads: h, numKvHeads: kvh, headDim: hd } = arch;
  const linear = (name: string, fanIn: number, fanOut: number, gain: number): void => {
    weights.set(name, { data: uniform(rng(name), fanIn * fanOut, gain / Math.sqrt(fanIn)), dims: [fanIn, fanOut] });
  };

  const embed = uniform(rng('model.embed_tokens.weight'), arch.vocabSize * d, INIT.embeddingStd);
  const scaleRow = (id: number, factor: number): void => {
    for (let j = 0; j < d; j++) embed[id * d + j] = (embed[id * d + j] as number) * factor;
  };
  scaleRow(special.eos, INIT.eosRowScale);
  for (const id of special.quiet) scaleRow(id, INIT.quietRowScale);
  weights.set('model.embed_tokens.weight', { data: embed, dims: [arch.vocabSize, d] });

  for (let i = 0; i < arch.numLayers; i++) {
    const p = `model.layers.${i}`;
    weights.set(`${p}.input_layernorm.weight`, { data: normWeight(rng(`${p}.input_layernorm.weight`), d, 1), dims: [d] });
    linear(`${p}.self_attn.q_proj.weight`, d, h * hd, INIT.projectionGain);
    linear(`${p}.self_attn.k_proj.weight`, d, kvh * hd, INIT.projectionGain);
    linear(`${p}.self_attn.v_proj.weight`, d, kvh * hd, INIT.projectionGain);
    linear(`${p}.self_attn.o_proj.weight`, h * hd, d, INIT.residualGain);
    weights.set(`${p}.post_attention_layernorm.weight`, {
      data: normWeight(rng(`${p}.post_attention_layernorm.weight`), d, 1),
      dims: [d],
    });
    linear(`${p}.mlp.gate_proj.weight`, d, inter, INIT.projectionGain);
    linear(`${p}.mlp.up_proj.weight`, d, inter, INIT.projectionGain);
    linear(`${p}.mlp.down_proj.weight`, inter, d, INIT.residualGain);
  }
  installAntiRepeatHead(weights, arch, rng('anti-repeat'));
  weights.set('model.norm.weight', { data: normWeight(rng('model.norm.weight'), d, INIT.logitScale), dims: [d] });
  weights.set('model.rotary_emb.inv_freq', { data: rotaryInvFreq(arch), dims: [hd / 2] });
  return weights;
}

/**
 * Turns layer 0's first KV head group into an anti-repetition head: near-zero queries (uniform
 * attention over the visible context), values V = x·U for a random d×hd matrix U, and outputs
 * −gain·V·Uᵀ spread over the query heads of the group. The layer then adds −gain·mean(x_t)·U·Uᵀ to
 * the residual stream, which lowers the logits of the tokens the context is full of.
 */
function installAntiRepeatHead(weights: LlamaWeights, arch: LlamaArchitecture, rng: Prng): void {
  const { hiddenSize: d, numHeads: h, numKvHeads: kvh, headDim: hd } = arch;
  const rep = h / kvh;
  const q = weights.get('model.layers.0.self_attn.q_proj.weight')?.data;
  const v = weights.get('model.layers.0.self_attn.v_proj.weight')?.data;
  const o = weights.get('model.layers.0.self_attn.o_proj.weight')?.data;
  if (q === undefined || v === undefined || o === undefined) throw new Error('layer 0 attention weights missing');
  const u = uniform(rng, d * hd, 1 / Math.sqrt(d)); // [d, hd]
  // U·Uᵀ keeps about hd/d of a vector: scale so the penalty is alike across presets.
  const gain = INIT.antiRepeatGain * Math.sqrt(d / (4 * hd));
  for (let i = 0; i < d; i++) {
    for (let c = 0; c < rep * hd; c++) q[i * h * hd + c] = (q[i * h * hd + c] as number) * 0.01;
    for (let c = 0; c < hd; c++) v[i * kvh * hd + c] = u[i * hd + c] as number;
  }
  for (let head = 0; head < rep; head++) {
    for (let c = 0; c < hd; c++) {
      for (let j = 0; j < d; j++) o[(head * hd + c) * d + j] = (-gain / rep) * (u[j * hd + c] as number);
    }
  }
}

/** Number of model parameters (the rotary frequencies are a buffer, not a parameter). */
export function countParameters(weights: LlamaWeights): number {
  let total = 0;
  for (const [name, tensor] of weights) if (name !== 'model.rotary_emb.inv_freq') total += tensor.data.length;
  return total;
}
