import { OnnxGraphBuilder, type ModelInfo } from './onnx-graph-builder.js';
import type { LlamaArchitecture } from './presets.js';
import type { LlamaWeights } from './llama-weights.js';

/**
 * Symbolic dimension names of Optimum-style Llama exports. The attention-mask / present length is
 * `total_sequence_length` (Optimum's own exporter writes `past_sequence_length + sequence_length`;
 * other exporters use this name). ORT and transformers.js go by shapes, not by these names.
 */
export const DIM = {
  batch: 'batch_size',
  sequence: 'sequence_length',
  past: 'past_sequence_length',
  total: 'total_sequence_length',
} as const;

/**
 * Finite "minus infinity" added to masked attention scores (float32's lowest value, as HF does).
 * A row whose keys are all masked (a padding query) becomes a uniform softmax, never NaN.
 */
export const MASK_VALUE = -3.4028234663852886e38;

/**
 * How attention is written in the graph:
 * - `plain`: standard opset-17 operators only (any ONNX runtime, transformers.js). Scores and the
 *   weighted sum are computed over the past and the step's new keys/values separately, so the
 *   `present.*` Concat feeds only the graph outputs: a runtime that does not fetch `present.*`
 *   (the engine keeps its own cache) can drop it, and no step copies the cache.
 * - `gqa`: onnxruntime's `com.microsoft` GroupQueryAttention, as onnxruntime-genai's model builder
 *   exports (rotary applied before it, `do_rotary` off). It takes each row's real length from the
 *   attention mask's sum (`seqlens_k`), so rows must be right-padded or unpadded (its real slots
 *   first); the mask's positions are not read.
 * - `gqa-fused`: the form onnxruntime-genai's model builder writes for CPU: GroupQueryAttention
 *   takes the packed q/k/v projection as its only query input and applies rotary itself
 *   (`do_rotary` 1, from `cos_cache`/`sin_cache` initializers and each row's `seqlens_k`), so the
 *   graph has no `position_ids` input. Rows must be unpadded or right-padded, as in `gqa`.
 * - `sdpa`: what Optimum exports of Hugging Face models (onnx-community's plain files) hold, standard
 *   operators as torch's TorchScript exporter writes transformers' SDPA attention: the keys and
 *   values of the `present.*` Concat repeated over each group's query heads (`repeat_kv`: Unsqueeze,
 *   Expand, Reshape), the keys transposed, queries and transposed keys each multiplied by the square
 *   root of a scale computed from the query's shape, MatMul, the additive mask [B, 1, S, T], Softmax,
 *   MatMul. Attention reads the concatenated cache, so every step copies it.
 */
export type AttentionForm = 'plain' | 'gqa' | 'gqa-fused' | 'sdpa';

/**
 * Builds the ONNX graph of a Llama decoder with a KV cache, from standard opset-17 operators
 * (plus GroupQueryAttention in the `gqa` form).
 *
 * Inputs and outputs follow Optimum's `text-generation-with-past` export, so the graph can be run
 * by anything that runs those (our engine, transformers.js):
 * `input_ids`, `attention_mask`, `position_ids` (not in the `gqa-fused` form),
 * `past_key_values.{i}.key|value` → `logits`, `present.{i}.key|value`.
 *
 * The attention mask is causal on cache slots (query slot `past + s` sees key slots `<= past + s`)
 * AND the caller's `attention_mask[b, key]`, so left-padded batches and masked gaps are exact.
 */
export function buildLlamaGraph(
  arch: LlamaArchitecture,
  weights: LlamaWeights,
  info: ModelInfo,
  attention: AttentionForm = 'plain',
): Uint8Array {
  const g = new OnnxGraphBuilder('sluice_tiny_llama');
  const { hiddenSize: d, numHeads: h, numKvHeads: kvh, headDim: hd, vocabSize: v } = arch;

  const inputIds = g.input('input_ids', 'int64', [DIM.batch, DIM.sequence]);
  const attentionMask = g.input('attention_mask', 'int64', [DIM.batch, DIM.total]);
  const fusedRotary = attention === 'gqa-fused';
  const positionIds = fusedRotary ? undefined : g.input('position_ids', 'int64', [DIM.batch, DIM.sequence]);
  const past: Array<{ key: string; value: string }> = [];
  for (let i = 0; i < arch.numLayers; i++) {
    past.push({
      key: g.input(`past_key_values.${i}.key`, 'float32', [DIM.batch, kvh, DIM.past, hd]),
      value: g.input(`past_key_values.${i}.value`, 'float32', [DIM.batch, kvh, DIM.past, hd]),
    });
  }

  const weight = (name: string): string => {
    const tensor = weights.get(name);
    if (tensor === undefined) throw new Error(`missing weight ${name}`);
    return g.initializer(name, tensor.data, tensor.dims);
  };

  // Embedding. The same matrix is the output projection (tied embeddings).
  const embedTokens = weight('model.embed_tokens.weight');
  g.scope = '/model/embed_tokens';
  let hidden = g.op('Gather', [embedTokens, inputIds], { axis: { int: 0 } });

  // Grouped-query attention runs per KV head, the cache never expanded or copied per query head, and
  // written so that onnxruntime's GEMM reads the cache in place instead of packing it first
  // (docs/engine.md): scores and values as one matrix-vector product per query head in a decode step
  // (the keys and values broadcast as [batch, kv_heads, 1, slots, head_dim] over the rep heads of
  // their group).
  const rep = h / kvh;

  // Additive attention mask [batch, 1, 1, sequence, total], shared by all layers and heads.
  g.scope = '/model/attn_mask';
  const scalarAt = (shape: string, index: number): string => g.op('Gather', [shape, g.int64([index], [])], { axis: { int: 0 } });
  const idsShape = g.op('Shape', [inputIds]);
  const maskShape = g.op('Shape', [attentionMask]);
  const sequence = scalarAt(idsShape, 1);
  const total = scalarAt(maskShape, 1);
  const pastLength = g.op('Sub', [total, sequence]);
  const one = g.int64([1], []);
  const querySlots = g.op('Range', [pastLength, total, one]); // [S]: past .. total-1
  const keySlots = g.op('Range', [g.int64([0], []), total, one]); // [T]: 0 .. total-1
  const causal = g.op('LessOrEqual', [
    g.op('Unsqueeze', [keySlots, g.int64([0])]), // [1, T]
    g.op('Unsqueeze', [querySlots, g.int64([1])]), // [S, 1]
  ]); // [S, T]: query slot past+s sees key slots up to itself
  const keyAllowed = g.op('Cast', [g.op('Unsqueeze', [attentionMask, g.int64([1, 2, 3])])], { to: { int: 9 } }); // [B,1,1,1,T]
  const allowed = g.op('And', [keyAllowed, causal]); // [B, 1, 1, S, T]: broadcast over heads
  const additiveMask = g.op('Where', [allowed, g.float32([0], []), g.float32([MASK_VALUE], [])]);
  const zero1d = g.int64([0]);
  const past1d = g.op('Unsqueeze', [pastLength, g.int64([0])]);
  const total1d = g.op('Unsqueeze', [total, g.int64([0])]);
  // GroupQueryAttention's per-row real lengths: mask sum − 1 (its `seqlens_k`), and the batch's total.
  const gqaLengths =
    attention === 'gqa' || attention === 'gqa-fused'
      ? {
          seqlensK: g.op('Cast', [g.op('Sub', [g.op('ReduceSum', [attentionMask, g.int64([1])], { keepdims: { int: 0 } }), one])], {
            to: { int: 6 },
          }),
          total: g.op('Cast', [total], { to: { int: 6 } }),
        }
      : undefined;

  // Rotary embeddings from position_ids: cos/sin [batch, 1, sequence, head_dim] (rotate-half layout).
  // The fused form's operator reads cos/sin tables [max position, head_dim / 2] instead.
  g.scope = '/model/rotary_emb';
  const rotary =
    positionIds === undefined ? undefined : rotaryFromPositions(g, positionIds, weight('model.rotary_emb.inv_freq'), hd, attention);
  const rotaryTables = fusedRotary ? cosSinTables(g, weights, arch.maxPositionEmbeddings) : undefined;

  const rmsNorm = (x: string, weightName: string): string => {
    // Pow(x, 2), not x·x: onnxruntime fuses Pow → ReduceMean → Add → Sqrt → Div → Mul into one
    // SimplifiedLayerNormalization kernel (17 norms × 5 nodes fewer per call; a batch-1 decode step
    // is dominated by per-node overhead beside the weight reads).
    const meanSquare = g.op('ReduceMean', [g.op('Pow', [x, g.float32([2], [])])], { axes: { ints: [-1] }, keepdims: { int: 1 } });
    const rms = g.op('Sqrt', [g.op('Add', [meanSquare, g.float32([arch.rmsNormEps], [])])]);
    return g.op('Mul', [g.op('Div', [x, rms]), weight(weightName)]);
  };
  /** Concatenates weights along the output axis; ORT folds it into one constant at load time. */
  const fused = (...names: string[]): string => g.op('Concat', names.map(weight), { axis: { int: 1 } });

  const presents: Array<{ key: string; value: string }> = [];
  for (let i = 0; i < arch.numLayers; i++) {
    const p = `model.layers.${i}`;
    const layerPast = past[i] as { key: string; value: string };
    g.scope = `/model/layers.${i}/self_attn`;
    const x = rmsNorm(hidden, `${p}.input_layernorm.weight`);
    // One MatMul for q, k and v.
    const qkvWeight = fused(`${p}.self_attn.q_proj.weight`, `${p}.self_attn.k_proj.weight`, `${p}.self_attn.v_proj.weight`);
    const qkvFlat = g.op('MatMul', [x, qkvWeight]);
    let merged: string;
    if (gqaLengths !== undefined && rotaryTables !== undefined) {
      // The packed [B, S, (h + 2·kvh)·hd] projection is the operator's only q/k/v input; it rotates q and k itself.
      const [context, presentKey, presentValue] = g.node(
        'GroupQueryAttention',
        [qkvFlat, '', '', layerPast.key, layerPast.value, gqaLengths.seqlensK, gqaLengths.total, rotaryTables.cos, rotaryTables.sin],
        {
          domain: 'com.microsoft',
          attributes: {
            num_heads: { int: h },
            kv_num_heads: { int: kvh },
            scale: { float: 1 / Math.sqrt(hd) },
            do_rotary: { int: 1 },
            rotary_interleaved: { int: 0 },
          },
          outputNames: [`${g.scope}/GroupQueryAttention_${i}/output_0`, `present.${i}.key`, `present.${i}.value`],
        },
      ) as [string, string, string];
      presents.push({ key: presentKey, value: presentValue });
      merged = context;
    } else if (gqaLengths !== undefined && rotary !== undefined) {
      // [B, S, h + 2·kvh, hd]: rotary on q and k, then GroupQueryAttention on [B, S, heads·hd].
      const qkv = g.op('Reshape', [qkvFlat, g.int64([0, 0, h + 2 * kvh, hd])]);
      const [qk, value] = g.node('Split', [qkv, g.int64([h + kvh, kvh])], { attributes: { axis: { int: 2 } }, outputs: 2 }) as [
        string,
        string,
      ];
      const [query, key] = g.node('Split', [rotary.apply(qk), g.int64([h, kvh])], { attributes: { axis: { int: 2 } }, outputs: 2 }) as [
        string,
        string,
      ];
      const flat = (t: string, heads: number): string => g.op('Reshape', [t, g.int64([0, 0, heads * hd])]);
      const [context, presentKey, presentValue] = g.node(
        'GroupQueryAttention',
        [flat(query, h), flat(key, kvh), flat(value, kvh), layerPast.key, layerPast.value, gqaLengths.seqlensK, gqaLengths.total],
        {
          domain: 'com.microsoft',
          attributes: { num_heads: { int: h }, kv_num_heads: { int: kvh }, scale: { float: 1 / Math.sqrt(hd) } },
          outputNames: [`${g.scope}/GroupQueryAttention_${i}/output_0`, `present.${i}.key`, `present.${i}.value`],
        },
      ) as [string, string, string];
      presents.push({ key: presentKey, value: presentValue });
      merged = context;
    } else if (rotary !== undefined) {
      // [B, h + 2·kvh, S, hd].
      const qkv = g.op('Transpose', [g.op('Reshape', [qkvFlat, g.int64([0, 0, h + 2 * kvh, hd])])], { perm: { ints: [0, 2, 1, 3] } });
      const [qk, value] = g.node('Split', [qkv, g.int64([h + kvh, kvh])], { attributes: { axis: { int: 1 } }, outputs: 2 }) as [
        string,
        string,
      ];
      const [query, key] = g.node('Split', [rotary.apply(qk), g.int64([h, kvh])], { attributes: { axis: { int: 1 } }, outputs: 2 }) as [
        string,
        string,
      ];
      const concat = (pastTensor: string, current: string, name: string): string =>
        g.node('Concat', [pastTensor, current], { name, attributes: { axis: { int: 2 } } })[0] as string;
      presents.push({ key: concat(layerPast.key, key, `present.${i}.key`), value: concat(layerPast.value, value, `present.${i}.value`) });
      if (attention === 'sdpa') {
        // Over the present, as Optimum's exports attend (see {@link sdpaAttention}).
        merged = sdpaAttention(g, query, presents[i]!, g.op('Squeeze', [additiveMask, g.int64([1])]), { h, kvh, hd });
      } else {
        // Attention over the past and the new slots separately (never over present.*): the scores
        // are joined before the softmax, the weighted sums added after it.
        // [B, kvh, rep, S, hd]: each KV head's group of query heads (a view of [B, h, S, hd]).
        const groupQueries = g.op('Reshape', [query, g.int64([0, kvh, rep, -1, hd])]);
        const perGroup = (t: string): string => g.op('Unsqueeze', [t, g.int64([2])]); // [B, kvh, 1, T, hd]
        // query · keysᵀ per query head: onnxruntime fuses the Transpose into its MatMul, and a decode
        // step (S = 1, alpha 1) is MLAS's one-row kernel over the keys as they lie, no packing. The
        // scale comes after the Concat: next to the MatMul it would be folded into alpha, which sends
        // MLAS back to its packing path (docs/engine.md).
        const scoresOver = (keys: string): string =>
          g.op('MatMul', [groupQueries, g.op('Transpose', [perGroup(keys)], { perm: { ints: [0, 1, 2, 4, 3] } })]); // [B, kvh, rep, S, T]
        const scale = g.float32([1 / Math.sqrt(hd)], []);
        const scores = g.op('Mul', [g.op('Concat', [scoresOver(layerPast.key), scoresOver(key)], { axis: { int: -1 } }), scale]);
        const probs = g.op('Softmax', [g.op('Add', [scores, additiveMask])], { axis: { int: -1 } });
        const minusOne = g.int64([-1]);
        const probsPast = g.op('Slice', [probs, zero1d, past1d, minusOne]);
        const probsNew = g.op('Slice', [probs, past1d, total1d, minusOne]);
        const weighted = g.op('Add', [g.op('MatMul', [probsPast, perGroup(layerPast.value)]), g.op('MatMul', [probsNew, perGroup(value)])]); // [B, kvh, rep, S, hd]
        const context = g.op('Reshape', [weighted, g.int64([0, h, -1, hd])]); // [B, h, S, hd]
        merged = g.op('Reshape', [g.op('Transpose', [context], { perm: { ints: [0, 2, 1, 3] } }), g.int64([0, 0, h * hd])]);
      }
    } else {
      throw new Error(`attention form ${attention} has no rotary`);
    }
    hidden = g.op('Add', [hidden, g.op('MatMul', [merged, weight(`${p}.self_attn.o_proj.weight`)])]);

    g.scope = `/model/layers.${i}/mlp`;
    const y = rmsNorm(hidden, `${p}.post_attention_layernorm.weight`);
    const gateUp = g.op('MatMul', [y, fused(`${p}.mlp.gate_proj.weight`, `${p}.mlp.up_proj.weight`)]);
    const [gate, up] = g.node('Split', [gateUp, g.int64([arch.intermediateSize, arch.intermediateSize])], {
      attributes: { axis: { int: -1 } },
      outputs: 2,
    }) as [string, string];
    const silu = g.op('Mul', [gate, g.op('Sigmoid', [gate])]);
    hidden = g.op('Add', [hidden, g.op('MatMul', [g.op('Mul', [silu, up]), weight(`${p}.mlp.down_proj.weight`)])]);
  }

  g.scope = '/model/norm';
  const normed = rmsNorm(hidden, 'model.norm.weight');
  // logits = normed · Eᵀ with the embedding matrix itself (Gemm transB), not a transposed copy.
  g.scope = '/lm_head';
  const flat = g.op('Reshape', [normed, g.int64([-1, d])]);
  const flatLogits = g.op('Gemm', [flat, embedTokens], { transB: { int: 1 } });
  // [batch, positions] read off the hidden state itself (not input_ids), so a runtime that keeps
  // only the last position's hidden state (the engine's load-time rewrite) gets [batch, 1, vocab].
  const hiddenShape = g.op('Slice', [g.op('Shape', [normed]), g.int64([0]), g.int64([2])]);
  const outShape = g.op('Concat', [hiddenShape, g.int64([v])], { axis: { int: 0 } });
  const [logits] = g.node('Reshape', [flatLogits, outShape], { name: 'logits' }) as [string];

  g.output(logits, 'logits', 'float32', [DIM.batch, DIM.sequence, v]);
  presents.forEach((present, i) => {
    g.output(present.key, `present.${i}.key`, 'float32', [DIM.batch, kvh, DIM.total, hd]);
    g.output(present.value, `present.${i}.value`, 'float32', [DIM.batch, kvh, DIM.total, hd]);
  });
  return g.toBytes(info);
}

/**
 * Rotary embedding from `position_ids` in the graph (rotate-half layout): `apply(x)` = x·cos +
 * rotate_half(x)·sin, with cos/sin [B, 1, S, hd] for the plain form's [batch, heads, sequence, hd]
 * and [B, S, 1, hd] for GQA's [batch, sequence, heads, hd].
 */
function rotaryFromPositions(
  g: OnnxGraphBuilder,
  positionIds: string,
  invFreq: string,
  hd: number,
  attention: AttentionForm,
): { apply: (x: string) => string } {
  const positions = g.op('Cast', [g.op('Unsqueeze', [positionIds, g.int64([2])])], { to: { int: 1 } }); // [B,S,1]
  const freqs = g.op('Mul', [positions, invFreq]); // [B, S, hd/2]
  const angles = g.op('Unsqueeze', [g.op('Concat', [freqs, freqs], { axis: { int: -1 } }), g.int64([attention === 'gqa' ? 2 : 1])]);
  const cos = g.op('Cos', [angles]);
  const sin = g.op('Sin', [angles]);
  // rotate_half(x) = concat(-x2, x1) as x·R: R is a signed permutation, so the product is exact.
  const rotateHalf = new Float32Array(hd * hd);
  for (let j = 0; j < hd / 2; j++) {
    rotateHalf[(j + hd / 2) * hd + j] = -1; // out[j] = -x[j + hd/2]
    rotateHalf[j * hd + j + hd / 2] = 1; // out[j + hd/2] = x[j]
  }
  const rotateHalfMatrix = g.initializer('/model/rotary_emb/rotate_half', rotateHalf, [hd, hd]);
  return { apply: (x) => g.op('Add', [g.op('Mul', [x, cos]), g.op('Mul', [g.op('MatMul', [x, rotateHalfMatrix]), sin])]) };
}

/**
 * GroupQueryAttention's rotary tables, `cos_cache` and `sin_cache` [maxPositions, hd / 2]: the
 * angle of position p and frequency j is p · inv_freq[j], rounded to float32 as the graph forms do.
 */
function cosSinTables(g: OnnxGraphBuilder, weights: LlamaWeights, maxPositions: number): { cos: string; sin: string } {
  const invFreq = weights.get('model.rotary_emb.inv_freq')?.data;
  if (!(invFreq instanceof Float32Array)) throw new Error('missing weight model.rotary_emb.inv_freq');
  const half = invFreq.length;
  const cos = new Float32Array(maxPositions * half);
  const sin = new Float32Array(maxPositions * half);
  for (let p = 0; p < maxPositions; p++) {
    for (let j = 0; j < half; j++) {
      const angle = Math.fround(p * invFreq[j]!);
      cos[p * half + j] = Math.cos(angle);
      sin[p * half + j] = Math.sin(angle);
    }
  }
  return {
    cos: g.initializer('cos_cache', cos, [maxPositions, half]),
    sin: g.initializer('sin_cache', sin, [maxPositions, half]),
  };
}

/**
 * Attention as torch's TorchScript exporter writes transformers' SDPA path (Optimum's exports):
 * `repeat_kv` on the present keys and values ([B, kvh, T, hd] → Unsqueeze → Expand [B, kvh, rep, T,
 * hd] → Reshape [B, h, T, hd]), the keys transposed, queries and transposed keys each multiplied by
 * √scale with scale = 1 / √(the query's last dimension, read from its Shape), MatMul, the additive
 * mask [B, 1, S, T], Softmax, MatMul; [B, S, h·hd] out.
 */
function sdpaAttention(
  g: OnnxGraphBuilder,
  query: string,
  present: { key: string; value: string },
  mask: string,
  shape: { h: number; kvh: number; hd: number },
): string {
  const { h, kvh, hd } = shape;
  const dim = (t: string, index: number): string => g.op('Gather', [g.op('Shape', [t]), g.int64([index])], { axis: { int: 0 } }); // [1]
  const repeatKv = (t: string): string => {
    const [batch, slots] = [dim(t, 0), dim(t, 2)];
    const expandTo = g.op('Concat', [batch, g.int64([kvh, h / kvh]), slots, g.int64([hd])], { axis: { int: 0 } });
    const expanded = g.op('Expand', [g.op('Unsqueeze', [t, g.int64([2])]), expandTo]);
    return g.op('Reshape', [expanded, g.op('Concat', [batch, g.int64([h]), slots, g.int64([hd])], { axis: { int: 0 } })]);
  };
  const queryWidth = g.op('Cast', [g.op('Slice', [g.op('Shape', [query]), g.int64([-1]), g.int64([Number.MAX_SAFE_INTEGER])])], {
    to: { int: 1 },
  });
  const scale = g.op('Div', [g.float32([1], []), g.op('Sqrt', [queryWidth])]);
  const keysT = g.op('Transpose', [repeatKv(present.key)], { perm: { ints: [0, 1, 3, 2] } });
  const scores = g.op('MatMul', [g.op('Mul', [query, g.op('Sqrt', [scale])]), g.op('Mul', [keysT, g.op('Sqrt', [scale])])]);
  const probs = g.op('Softmax', [g.op('Add', [scores, mask])], { axis: { int: -1 } });
  const context = g.op('MatMul', [probs, repeatKv(present.value)]); // [B, h, S, hd]
  return g.op('Reshape', [g.op('Transpose', [context], { perm: { ints: [0, 2, 1, 3] } }), g.int64([0, 0, h * hd])]);
}
