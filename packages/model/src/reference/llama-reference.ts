import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import onnxProto from 'onnx-proto';
import { exactOnnxInt64 } from '../onnx-proto.js';

const { onnx } = onnxProto;

/**
 * A plain float64 TypeScript forward pass of a Llama model, over the weights stored in a generated
 * model directory. It shares no code with the ONNX graph builder: tests compare the two to prove the
 * graph computes a Llama decoder (RMSNorm, rotate-half RoPE from position_ids, GQA with a KV cache,
 * causal ∧ attention_mask masking, SwiGLU, tied output projection).
 *
 * It is slow (no SIMD, no threads) and meant for the tiny preset only.
 */

/** Hyper-parameters read from `config.json`. */
export interface ReferenceConfig {
  vocabSize: number;
  hiddenSize: number;
  intermediateSize: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  rmsNormEps: number;
  ropeTheta: number;
}

/** Per-layer keys and values, each `[batch, kv_heads, length, head_dim]` row-major. */
export interface ReferenceKvCache {
  length: number;
  keys: Float64Array[];
  values: Float64Array[];
}

/** One forward call; `attentionMask` rows are `past + sequence` long. */
export interface ReferenceInput {
  inputIds: readonly (readonly number[])[];
  attentionMask: readonly (readonly number[])[];
  positionIds: readonly (readonly number[])[];
  past?: ReferenceKvCache;
}

export interface ReferenceOutput {
  /** `[batch, sequence, vocab]` row-major. */
  logits: Float64Array;
  present: ReferenceKvCache;
}

/** The additive mask value of masked scores (float32's lowest), as in the HF implementation. */
const MASKED = -3.4028234663852886e38;

function readConfig(json: Record<string, unknown>): ReferenceConfig {
  const num = (key: string): number => {
    const value = json[key];
    if (typeof value !== 'number') throw new Error(`config.json: ${key} is not a number`);
    return value;
  };
  return {
    vocabSize: num('vocab_size'),
    hiddenSize: num('hidden_size'),
    intermediateSize: num('intermediate_size'),
    numLayers: num('num_hidden_layers'),
    numHeads: num('num_attention_heads'),
    numKvHeads: num('num_key_value_heads'),
    headDim: num('head_dim'),
    rmsNormEps: num('rms_norm_eps'),
    ropeTheta: num('rope_theta'),
  };
}

/** Float32 initializers of an ONNX model by name, widened to float64. */
export function readOnnxWeights(modelBytes: Uint8Array): Map<string, Float64Array> {
  exactOnnxInt64();
  const model = onnx.ModelProto.decode(modelBytes);
  const weights = new Map<string, Float64Array>();
  for (const tensor of model.graph?.initializer ?? []) {
    if (tensor.dataType !== onnx.TensorProto.DataType.FLOAT || !tensor.rawData) continue;
    // rawData may be a misaligned view into the file buffer: read it through a DataView.
    const raw = tensor.rawData;
    const view = new DataView(raw.buffer, raw.byteOffset, raw.byteLength);
    const out = new Float64Array(raw.byteLength / 4);
    for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(i * 4, true);
    weights.set(tensor.name ?? '', out);
  }
  return weights;
}

export class LlamaReference {
  private constructor(
    readonly config: ReferenceConfig,
    private readonly weights: Map<string, Float64Array>,
  ) {}

  /** Loads `config.json` and the initializers of `onnx/model.onnx` from a model directory. */
  static async load(modelDir: string): Promise<LlamaReference> {
    const config = JSON.parse(await readFile(join(modelDir, 'config.json'), 'utf8')) as Record<string, unknown>;
    const bytes = await readFile(join(modelDir, 'onnx', 'model.onnx'));
    return new LlamaReference(readConfig(config), readOnnxWeights(bytes));
  }

  forward(input: ReferenceInput): ReferenceOutput {
    const c = this.config;
    const batch = input.inputIds.length;
    const seq = input.inputIds[0]?.length ?? 0;
    const pastLength = input.past?.length ?? 0;
    const total = pastLength + seq;
    const { hiddenSize: d, numHeads: h, numKvHeads: kvh, headDim: hd, vocabSize: v } = c;
    const rep = h / kvh;
    const embed = this.w('model.embed_tokens.weight');

    // hidden[b][s] = E[id]
    const hidden: Float64Array[][] = input.inputIds.map((row) => row.map((id) => embed.slice(id * d, id * d + d)));

    const allowed = (b: number, s: number, t: number): boolean => t <= pastLength + s && (input.attentionMask[b]?.[t] ?? 0) !== 0;

    const invFreq = Array.from({ length: hd / 2 }, (_, j) => 1 / c.ropeTheta ** ((2 * j) / hd));
    const rope = (vec: Float64Array, position: number): Float64Array => {
      const out = new Float64Array(hd);
      const half = hd / 2;
      for (let j = 0; j < half; j++) {
        const angle = position * (invFreq[j] as number);
        const cos = Math.cos(angle);
        const sin = Math.sin(angle);
        const x1 = vec[j] as number;
        const x2 = vec[j + half] as number;
        out[j] = x1 * cos - x2 * sin;
        out[j + half] = x2 * cos + x1 * sin;
      }
      return out;
    };

    const present: ReferenceKvCache = { length: total, keys: [], values: [] };
    for (let layer = 0; layer < c.numLayers; layer++) {
      const p = `model.layers.${layer}`;
      const keys = new Float64Array(batch * kvh * total * hd);
      const values = new Float64Array(batch * kvh * total * hd);
      const kvIndex = (b: number, head: number, t: number): number => ((b * kvh + head) * total + t) * hd;
      if (input.past !== undefined) {
        const pk = input.past.keys[layer] as Float64Array;
        const pv = input.past.values[layer] as Float64Array;
        for (let b = 0; b < batch; b++) {
          for (let head = 0; head < kvh; head++) {
            for (let t = 0; t < pastLength; t++) {
              const from = ((b * kvh + head) * pastLength + t) * hd;
              keys.set(pk.subarray(from, from + hd), kvIndex(b, head, t));
              values.set(pv.subarray(from, from + hd), kvIndex(b, head, t));
            }
          }
        }
      }

      const queries: Float64Array[][][] = []; // [b][s][head] → hd
      for (let b = 0; b < batch; b++) {
        queries.push([]);
        for (let s = 0; s < seq; s++) {
          const x = this.rmsNorm(hidden[b]?.[s] as Float64Array, `${p}.input_layernorm.weight`);
          const q = this.matVec(x, `${p}.self_attn.q_proj.weight`, h * hd);
          const k = this.matVec(x, `${p}.self_attn.k_proj.weight`, kvh * hd);
          const val = this.matVec(x, `${p}.self_attn.v_proj.weight`, kvh * hd);
          const position = input.positionIds[b]?.[s] as number;
          queries[b]?.push(Array.from({ length: h }, (_, head) => rope(q.subarray(head * hd, head * hd + hd), position)));
          for (let head = 0; head < kvh; head++) {
            keys.set(rope(k.subarray(head * hd, head * hd + hd), position), kvIndex(b, head, pastLength + s));
            values.set(val.subarray(head * hd, head * hd + hd), kvIndex(b, head, pastLength + s));
          }
        }
      }
      present.keys.push(keys);
      present.values.push(values);

      for (let b = 0; b < batch; b++) {
        for (let s = 0; s < seq; s++) {
          const merged = new Float64Array(h * hd);
          for (let head = 0; head < h; head++) {
            const kvHead = Math.floor(head / rep);
            const q = queries[b]?.[s]?.[head] as Float64Array;
            const scores = new Float64Array(total);
            for (let t = 0; t < total; t++) {
              let dot = 0;
              const base = kvIndex(b, kvHead, t);
              for (let j = 0; j < hd; j++) dot += (q[j] as number) * (keys[base + j] as number);
              scores[t] = dot / Math.sqrt(hd) + (allowed(b, s, t) ? 0 : MASKED);
            }
            const probs = softmax(scores);
            for (let t = 0; t < total; t++) {
              const base = kvIndex(b, kvHead, t);
              const pt = probs[t] as number;
              for (let j = 0; j < hd; j++) merged[head * hd + j] = (merged[head * hd + j] as number) + pt * (values[base + j] as number);
            }
          }
          const attnOut = this.matVec(merged, `${p}.self_attn.o_proj.weight`, d);
          const row = hidden[b]?.[s] as Float64Array;
          for (let j = 0; j < d; j++) row[j] = (row[j] as number) + (attnOut[j] as number);

          const y = this.rmsNorm(row, `${p}.post_attention_layernorm.weight`);
          const gate = this.matVec(y, `${p}.mlp.gate_proj.weight`, c.intermediateSize);
          const up = this.matVec(y, `${p}.mlp.up_proj.weight`, c.intermediateSize);
          const act = gate.map((g, i) => (g / (1 + Math.exp(-g))) * (up[i] as number));
          const mlpOut = this.matVec(act, `${p}.mlp.down_proj.weight`, d);
          for (let j = 0; j < d; j++) row[j] = (row[j] as number) + (mlpOut[j] as number);
        }
      }
    }

    const logits = new Float64Array(batch * seq * v);
    for (let b = 0; b < batch; b++) {
      for (let s = 0; s < seq; s++) {
        const x = this.rmsNorm(hidden[b]?.[s] as Float64Array, 'model.norm.weight');
        const base = (b * seq + s) * v;
        for (let id = 0; id < v; id++) {
          let dot = 0;
          for (let j = 0; j < d; j++) dot += (x[j] as number) * (embed[id * d + j] as number);
          logits[base + id] = dot;
        }
      }
    }
    return { logits, present };
  }

  private w(name: string): Float64Array {
    const tensor = this.weights.get(name);
    if (tensor === undefined) throw new Error(`model.onnx has no initializer ${name}`);
    return tensor;
  }

  private rmsNorm(x: Float64Array, weightName: string): Float64Array {
    const weight = this.w(weightName);
    let sum = 0;
    for (const value of x) sum += value * value;
    const scale = 1 / Math.sqrt(sum / x.length + this.config.rmsNormEps);
    return x.map((value, i) => value * scale * (weight[i] as number));
  }

  /** x · W with W stored `[in, out]` row-major (the ONNX MatMul layout). */
  private matVec(x: Float64Array, weightName: string, outSize: number): Float64Array {
    const weight = this.w(weightName);
    const out = new Float64Array(outSize);
    for (let i = 0; i < x.length; i++) {
      const xi = x[i] as number;
      const row = i * outSize;
      for (let o = 0; o < outSize; o++) out[o] = (out[o] as number) + xi * (weight[row + o] as number);
    }
    return out;
  }
}

function softmax(scores: Float64Array): Float64Array {
  let max = -Infinity;
  for (const s of scores) if (s > max) max = s;
  const out = scores.map((s) => Math.exp(s - max));
  const sum = out.reduce((a, b) => a + b, 0);
  return out.map((e) => e / sum);
}
