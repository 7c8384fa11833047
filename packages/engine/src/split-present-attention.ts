/**
 * Part of the load-time rewrite (`rewrite-decoder-graph.ts`): attention that an export computes over
 * `present.*` — the Concat of the past and the step's new keys/values — rewritten to read the past and
 * the new slots separately, as the generator's plain form does. Optimum's exports (torch's exporter
 * writing transformers' attention) attend over the Concat, so every layer copied its whole cache in
 * every step, and for grouped-query models copied it again per query head (`repeat_kv`: Unsqueeze,
 * Expand, Reshape). Why and what it gave: docs/engine.md, "KV cache".
 */
import onnxProto from 'onnx-proto';
import { groupedAttention, int, NodeList } from './plain-attention.js';

const { onnx } = onnxProto;
type Node = onnxProto.onnx.INodeProto;
type Tensor = onnxProto.onnx.ITensorProto;

/** One layer's Concats of past and new slots (`present.{i}.key|value` before the rewrite). */
export interface PresentConcats {
  key: Node;
  value: Node;
}

/** The shapes every layer shares, made once before the first layer's attention. */
interface Shared {
  /** [5] int64: [batch, kvHeads, queries per KV head, new slots, headDim] for the queries' grouped view. */
  groupShape: string;
  /** [4] int64: [batch, heads, new slots, headDim]. */
  headShape: string;
  /** [1] int64: the past's slot count; and past + new. */
  past: string;
  total: string;
}

/** What {@link splitPresentAttention} found for one layer. */
interface Region {
  /** [batch, heads, new, headDim], as the scores' MatMul takes it (scaled or not). */
  query: string;
  /** Multipliers of the scores, in order: the keys' own (`Mul` after their Transpose), then the scores'. */
  scales: Array<{ opType: 'Mul' | 'Div'; operand: string }>;
  /** The additive mask (rank 4: [batch, 1, new, total]), where there is one. */
  mask: string | undefined;
  /** The weighted sum's MatMul: replaced, its output kept. */
  output: Node;
}

const SHAPE_OPS = new Set(['Unsqueeze', 'Expand', 'Reshape']);

/**
 * For each layer whose attention reads its key and value Concats only through `repeat_kv` (Unsqueeze,
 * Expand, Reshape), a Transpose of the keys' last two axes, an optional scalar Mul, then `MatMul(query,
 * keysᵀ)` → optional Mul/Div → optional Add (mask) → Softmax (last axis) → optional Cast to float →
 * `MatMul(probabilities, values)`: nodes that compute the same output from each KV head's group of
 * query heads against the past and the new slots separately (one-row products in a decode step), the
 * scales and the mask applied to the joined scores, the weighted sums over the past and the new values
 * added. Returns the nodes to put before each replaced MatMul (key: that node) and their constants;
 * layers in another form are left as they are. The Concats then feed only `present.*`, which the
 * rewrite drops, and the dead-node pass removes them with the repeat_kv copies.
 *
 * Assumes what torch's exporter writes for transformers: the query [batch, heads, new, headDim] and a
 * mask of rank 4 whose second axis is 1 (it is broadcast over each group's heads).
 */
export function splitPresentAttention(
  nodes: readonly Node[],
  layers: readonly PresentConcats[],
  kv: { kvHeads: number; headDim: number },
): { replaced: Map<Node, Node[]>; constants: Tensor[] } {
  const readers = new Map<string, Node[]>();
  for (const node of nodes) {
    for (const input of node.input ?? []) {
      const list = readers.get(input);
      if (list === undefined) readers.set(input, [node]);
      else list.push(node);
    }
  }
  const replaced = new Map<Node, Node[]>();
  const constants: Tensor[] = [];
  let shared: Shared | undefined;
  for (const [layer, concats] of layers.entries()) {
    const region = matchRegion(concats, readers);
    if (region === undefined) continue;
    const g = new NodeList(`sluice_split_attention/${layer}`);
    const [pastKey, newKey] = concats.key.input as [string, string];
    const [pastValue, newValue] = concats.value.input as [string, string];
    shared ??= sharedShapes(g, region.query, pastKey, newKey, kv);
    const groupQueries = g.op('Reshape', [region.query, shared.groupShape]); // [B, kvh, rep, S, hd]
    // The export's own scales in their order, then its mask broadcast over each group's heads.
    const weighted = groupedAttention(g, groupQueries, { pastKey, newKey, pastValue, newValue }, shared, (raw) => {
      let scores = raw;
      for (const { opType, operand } of region.scales) scores = g.op(opType, [scores, operand]);
      return region.mask === undefined ? scores : g.op('Add', [scores, g.op('Unsqueeze', [region.mask, g.int64([1])])]);
    }); // [B, kvh, rep, S, hd]
    const output = region.output.output![0]!;
    g.nodes.push({ name: `${g.prefix}/output`, opType: 'Reshape', input: [weighted, shared.headShape], output: [output] });
    replaced.set(region.output, g.nodes);
    constants.push(...g.constants);
  }
  return { replaced, constants };
}

/** The grouped view's shape and the slot counts, from the first layer's query and cache. */
function sharedShapes(g: NodeList, query: string, pastKey: string, newKey: string, kv: { kvHeads: number; headDim: number }): Shared {
  const dim = (t: string, index: number) => g.op('Gather', [g.op('Shape', [t]), g.int64([index])], [int('axis', 0)]); // [1]
  const [batch, heads, queries] = [dim(query, 0), dim(query, 1), dim(query, 2)];
  const kvHeads = g.int64([kv.kvHeads]);
  const headDim = g.int64([kv.headDim]);
  const past = dim(pastKey, 2);
  return {
    groupShape: g.op('Concat', [batch, kvHeads, g.op('Div', [heads, kvHeads]), queries, headDim], [int('axis', 0)]),
    headShape: g.op('Concat', [batch, heads, queries, headDim], [int('axis', 0)]),
    past,
    total: g.op('Add', [past, dim(newKey, 2)]),
  };
}

/** The attention region reading one layer's Concats, or undefined when it is not in the form above. */
function matchRegion(concats: PresentConcats, readers: ReadonlyMap<string, Node[]>): Region | undefined {
  const only = (name: string | undefined): Node | undefined => {
    const found = (readers.get(name ?? '') ?? []).filter((node) => node.opType !== 'Shape');
    return found.length === 1 ? found[0] : undefined;
  };
  const throughRepeat = (from: Node): Node | undefined => {
    let node = only(from.output?.[0]);
    for (let depth = 0; node !== undefined && SHAPE_OPS.has(node.opType ?? '') && depth < 4; depth++) node = only(node.output?.[0]);
    return node;
  };
  const transpose = throughRepeat(concats.key);
  const perm = (transpose?.attribute ?? []).find((entry) => entry.name === 'perm')?.ints?.map(Number);
  if (transpose?.opType !== 'Transpose' || perm?.join(',') !== '0,1,3,2') return undefined;
  const scales: Region['scales'] = [];
  let keys = transpose;
  let next = only(keys.output?.[0]);
  if (next?.opType === 'Mul' && next.input?.[0] === keys.output?.[0]) {
    scales.push({ opType: 'Mul', operand: next.input![1]! });
    keys = next;
    next = only(keys.output?.[0]);
  }
  const scores = next;
  if (scores?.opType !== 'MatMul' || scores.input?.[1] !== keys.output?.[0]) return undefined;
  const query = scores.input![0]!;
  let last = scores.output?.[0];
  let at = only(last);
  if ((at?.opType === 'Mul' || at?.opType === 'Div') && at.input?.[0] === last) {
    scales.push({ opType: at.opType, operand: at.input![1]! });
    last = at.output?.[0];
    at = only(last);
  }
  let mask: string | undefined;
  if (at?.opType === 'Add') {
    const [a, b] = at.input as [string, string];
    mask = a === last ? b : a;
    last = at.output?.[0];
    at = only(last);
  }
  if (at?.opType !== 'Softmax') return undefined;
  const axis = Number((at.attribute ?? []).find((entry) => entry.name === 'axis')?.i ?? -1);
  if (axis !== -1 && axis !== 3) return undefined;
  let probs = at;
  at = only(at.output?.[0]);
  while (
    at?.opType === 'Cast' &&
    Number((at.attribute ?? []).find((entry) => entry.name === 'to')?.i) === Number(onnx.TensorProto.DataType.FLOAT)
  ) {
    probs = at;
    at = only(at.output?.[0]);
  }
  const values = throughRepeat(concats.value);
  if (at?.opType !== 'MatMul' || at !== values || at.input?.[0] !== probs.output?.[0]) return undefined;
  return { query, scales, mask, output: at };
}
