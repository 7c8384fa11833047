/**
 * Part of the load-time rewrite (`rewrite-decoder-graph.ts`): a GroupQueryAttention node (rotary
 * already before it) replaced by the attention the generator's plain form writes, over the past
 * and the step's new keys/values separately. GroupQueryAttention copies every row's real slots
 * into its `present` outputs in every layer of every step, fetched or not (the whole cache, what
 * the engine-owned cache exists to avoid); these ops read the past where it lies. Why and what it
 * gave: docs/engine.md, "KV cache".
 */
import onnxProto from 'onnx-proto';

const { onnx } = onnxProto;
type Node = onnxProto.onnx.INodeProto;
type Tensor = onnxProto.onnx.ITensorProto;

/** float32's lowest value: a masked slot's additive score (as Hugging Face and the generator use). */
const MASK_VALUE = -3.4028234663852886e38;

/** Names the shared mask subgraph produces (see {@link attentionMask}). */
export interface AttentionMask {
  /** [batch, 1, 1, new, total] float32: 0 where the query may see the key slot, else {@link MASK_VALUE}. */
  additive: string;
  /** [1] int64: the past's slot count, where the new slots start. */
  past: string;
  /** [1] int64: past + new slots. */
  total: string;
}

/** One GroupQueryAttention node's operands, in the layouts the rewrite has them. */
export interface AttentionOperands {
  /** [batch, new, heads·headDim], rotated. */
  query: string;
  /** [batch, kvHeads, new, headDim], rotated (the rewrite's new-slice output). */
  newKey: string;
  /** [batch, kvHeads, new, headDim]. */
  newValue: string;
  /** [batch, kvHeads, past, headDim]. */
  pastKey: string;
  pastValue: string;
}

/** Nodes and constants added under one name prefix (names made unique by a counter). */
export class NodeList {
  readonly nodes: Node[] = [];
  readonly constants: Tensor[] = [];
  #count = 0;
  constructor(readonly prefix: string) {}

  op(opType: string, input: string[], attributes: onnxProto.onnx.IAttributeProto[] = []): string {
    const name = `${this.prefix}/${opType}_${this.#count++}`;
    this.nodes.push({ name, opType, input, output: [name], attribute: attributes });
    return name;
  }

  int64(values: number[], dims: number[] = [values.length]): string {
    const name = `${this.prefix}/const_${this.#count++}`;
    this.constants.push({ name, dims, dataType: onnx.TensorProto.DataType.INT64, int64Data: values });
    return name;
  }

  float32(value: number): string {
    const name = `${this.prefix}/const_${this.#count++}`;
    this.constants.push({ name, dims: [], dataType: onnx.TensorProto.DataType.FLOAT, floatData: [value] });
    return name;
  }
}

const ints = (name: string, values: number[]): onnxProto.onnx.IAttributeProto => ({
  name,
  type: onnx.AttributeProto.AttributeType.INTS,
  ints: values,
});
export const int = (name: string, value: number): onnxProto.onnx.IAttributeProto => ({
  name,
  type: onnx.AttributeProto.AttributeType.INT,
  i: value,
});

/**
 * The additive mask shared by every layer, from the graph's `attention_mask` [batch, total] and
 * `input_ids` [batch, new]: query slot `past + s` sees key slot `t` when `t <= past + s` and the
 * mask has a 1 at `t` (so the engine's padded and empty slots weigh exactly 0).
 */
export function attentionMask(attentionMaskInput: string, inputIds: string): { mask: AttentionMask; nodes: Node[]; constants: Tensor[] } {
  const g = new NodeList('sluice_attention/mask');
  const at = (shape: string, index: number) => g.op('Gather', [shape, g.int64([index], [])], [int('axis', 0)]); // scalar
  const total = at(g.op('Shape', [attentionMaskInput]), 1);
  const past = g.op('Sub', [total, at(g.op('Shape', [inputIds]), 1)]);
  const one = g.int64([1], []);
  const zero = g.int64([0]);
  const querySlots = g.op('Range', [past, total, one]); // [S]: past .. total-1
  const keySlots = g.op('Range', [g.int64([0], []), total, one]); // [T]
  const causal = g.op('LessOrEqual', [g.op('Unsqueeze', [keySlots, zero]), g.op('Unsqueeze', [querySlots, g.int64([1])])]); // [S, T]
  const keyAllowed = g.op(
    'Cast',
    [g.op('Unsqueeze', [attentionMaskInput, g.int64([1, 2, 3])])],
    [int('to', onnx.TensorProto.DataType.BOOL)],
  ); // [B,1,1,1,T]
  const additive = g.op('Where', [g.op('And', [keyAllowed, causal]), g.float32(0), g.float32(MASK_VALUE)]); // [B,1,1,S,T]
  return {
    mask: { additive, past: g.op('Unsqueeze', [past, zero]), total: g.op('Unsqueeze', [total, zero]) },
    nodes: g.nodes,
    constants: g.constants,
  };
}

/**
 * The nodes computing `output` ([batch, new, heads·headDim]) as GroupQueryAttention does with
 * `scale`, written as the generator's plain form: each KV head's group of query heads against the
 * past keys and the new keys separately (one matrix-vector product per query head in a decode
 * step, the keys read in place; the scale applied after the scores are joined, so onnxruntime keeps
 * MLAS's one-row kernel), softmax over both under `mask`, weighted sums over the past and the new
 * values added.
 */
export function plainAttention(
  prefix: string,
  operands: AttentionOperands,
  shape: { heads: number; kvHeads: number; headDim: number; scale: number },
  mask: AttentionMask,
  output: string,
): { nodes: Node[]; constants: Tensor[] } {
  const { heads, kvHeads, headDim, scale } = shape;
  const g = new NodeList(prefix);
  const perHead = g.op('Transpose', [g.op('Reshape', [operands.query, g.int64([0, 0, heads, headDim])])], [ints('perm', [0, 2, 1, 3])]); // [B,h,S,hd]
  const groupQueries = g.op('Reshape', [perHead, g.int64([0, kvHeads, heads / kvHeads, -1, headDim])]); // [B,kvh,rep,S,hd]
  const weighted = groupedAttention(g, groupQueries, operands, mask, (scores) =>
    g.op('Add', [g.op('Mul', [scores, g.float32(scale)]), mask.additive]),
  ); // [B,kvh,rep,S,hd]
  const context = g.op('Transpose', [g.op('Reshape', [weighted, g.int64([0, heads, -1, headDim])])], [ints('perm', [0, 2, 1, 3])]);
  g.nodes.push({ name: `${prefix}/output`, opType: 'Reshape', input: [context, g.int64([0, 0, heads * headDim])], output: [output] });
  return { nodes: g.nodes, constants: g.constants };
}

/**
 * The attention of the generator's plain form on queries grouped per KV head ([batch, kvHeads,
 * queries per KV head, new, headDim]): scores against the past keys and the new keys separately
 * (one matrix-vector product per query head in a decode step, the keys read in place), joined,
 * `softmaxInput` applied to them (scales, mask: after the join, so onnxruntime keeps MLAS's one-row
 * kernel), softmax, weighted sums over the past and the new values added. Returns the weighted sums,
 * in the queries' grouped layout. `slots` says where the new slots start and end ([1] int64 each).
 */
export function groupedAttention(
  g: NodeList,
  groupQueries: string,
  kv: Omit<AttentionOperands, 'query'>,
  slots: { past: string; total: string },
  softmaxInput: (scores: string) => string,
): string {
  const two = g.int64([2]);
  const perGroup = (t: string) => g.op('Unsqueeze', [t, two]); // [B,kvh,1,T,hd]
  const scoresOver = (keys: string) => g.op('MatMul', [groupQueries, g.op('Transpose', [perGroup(keys)], [ints('perm', [0, 1, 2, 4, 3])])]);
  const scores = g.op('Concat', [scoresOver(kv.pastKey), scoresOver(kv.newKey)], [int('axis', -1)]); // [B,kvh,rep,S,T]
  const probs = g.op('Softmax', [softmaxInput(scores)], [int('axis', -1)]);
  const minusOne = g.int64([-1]);
  return g.op('Add', [
    g.op('MatMul', [g.op('Slice', [probs, g.int64([0]), slots.past, minusOne]), perGroup(kv.pastValue)]),
    g.op('MatMul', [g.op('Slice', [probs, slots.past, slots.total, minusOne]), perGroup(kv.newValue)]),
  ]);
}
