/**
 * Part of the load-time rewrite (`rewrite-decoder-graph.ts`): a GroupQueryAttention node that
 * applies rotary itself (`do_rotary` 1, what onnxruntime-genai's model builder exports for CPU,
 * usually with q/k/v packed into its first input) is turned into the form whose step keys can be
 * read off the graph: rotary as `com.microsoft` RotaryEmbedding nodes before the operator, fed from
 * the graph's `position_ids`. Why: docs/engine.md, "KV cache".
 */
import onnxProto from 'onnx-proto';

const { onnx } = onnxProto;

/** GroupQueryAttention's inputs by position (onnxruntime's contrib op schema). */
const GQA_INPUT = { query: 0, key: 1, value: 2, cosCache: 7, sinCache: 8, positionIds: 9 } as const;

/** The graph input the engine feeds each new token's position through. */
const POSITION_IDS = 'position_ids';

/** True for a `com.microsoft` GroupQueryAttention node with `do_rotary` set. */
export function appliesRotaryInside(node: onnxProto.onnx.INodeProto): boolean {
  return node.opType === 'GroupQueryAttention' && node.domain === 'com.microsoft' && Number(intAttribute(node, 'do_rotary') ?? 0) === 1;
}

/** The graph's `position_ids` input, added as int64 [batch, sequence] (the dims of `input_ids`) when missing. */
export function positionIdsInput(graph: onnxProto.onnx.IGraphProto): string {
  const inputs = graph.input ?? [];
  if (inputs.some((input) => input.name === POSITION_IDS)) return POSITION_IDS;
  const ids = inputs.find((input) => input.name === 'input_ids');
  const dims = ids?.type?.tensorType?.shape?.dim ?? [{ dimParam: 'batch_size' }, { dimParam: 'sequence_length' }];
  graph.input = [
    ...inputs,
    onnx.ValueInfoProto.create({
      name: POSITION_IDS,
      type: { tensorType: { elemType: onnx.TensorProto.DataType.INT64, shape: { dim: dims.map((dim) => ({ ...dim })) } } },
    }),
  ];
  return POSITION_IDS;
}

/**
 * Rewrites `node` (see {@link appliesRotaryInside}) in place to take q and k already rotated and
 * q/k/v unpacked, with `do_rotary` off, and returns the nodes that must run before it: a Split of
 * the packed projection (when packed) and one RotaryEmbedding for q and one for k, each at the
 * positions in `positions` with the node's own `cos_cache` / `sin_cache` and layout. onnxruntime
 * computes both with the same rotary routine, so the rotated values are the op's own. Undefined
 * (nothing changed) when the node's shape is not one this handles: positions passed to the op
 * itself, or rotary tables that are not initializers of [positions, rotaryDim / 2].
 */
export function rotaryBeforeAttention(
  node: onnxProto.onnx.INodeProto,
  positions: string,
  headDim: number,
  initializers: ReadonlyMap<string, onnxProto.onnx.ITensorProto>,
  defaultOpset: number,
): { nodes: onnxProto.onnx.INodeProto[]; constants: onnxProto.onnx.ITensorProto[] } | undefined {
  const inputs = node.input ?? [];
  const heads = Number(intAttribute(node, 'num_heads') ?? NaN);
  const kvHeads = Number(intAttribute(node, 'kv_num_heads') ?? NaN);
  const cos = inputs[GQA_INPUT.cosCache] ?? '';
  const sin = inputs[GQA_INPUT.sinCache] ?? '';
  const halfRotary = Number(initializers.get(cos)?.dims?.[1] ?? NaN);
  if (
    !Number.isInteger(heads) ||
    !Number.isInteger(kvHeads) ||
    !Number.isInteger(headDim) ||
    (inputs[GQA_INPUT.positionIds] ?? '') !== '' ||
    !initializers.has(sin) ||
    !Number.isInteger(halfRotary) ||
    halfRotary < 1 ||
    2 * halfRotary > headDim
  )
    return undefined;
  const base = `sluice_rotary/${node.name || node.output?.[0] || 'GroupQueryAttention'}`;
  const nodes: onnxProto.onnx.INodeProto[] = [];
  const constants: onnxProto.onnx.ITensorProto[] = [];
  let [query, key, value] = [inputs[GQA_INPUT.query] ?? '', inputs[GQA_INPUT.key] ?? '', inputs[GQA_INPUT.value] ?? ''];
  if (query === '') return undefined;
  if (key === '' || value === '') {
    if (key !== '' || value !== '') return undefined;
    // Packed [B, S, (heads + 2·kvHeads)·headDim] → q, k, v on the last axis.
    const sizes = [heads * headDim, kvHeads * headDim, kvHeads * headDim];
    [query, key, value] = [`${base}/query`, `${base}/key`, `${base}/value`];
    const split: onnxProto.onnx.INodeProto = {
      name: `${base}/Split`,
      opType: 'Split',
      input: [inputs[GQA_INPUT.query]!],
      output: [query, key, value],
      attribute: [{ name: 'axis', type: onnx.AttributeProto.AttributeType.INT, i: -1 }],
    };
    if (defaultOpset >= 13) {
      constants.push({ name: `${base}/split`, dims: [3], dataType: onnx.TensorProto.DataType.INT64, int64Data: sizes });
      split.input = [...split.input!, `${base}/split`];
    } else {
      split.attribute = [...split.attribute!, { name: 'split', type: onnx.AttributeProto.AttributeType.INTS, ints: sizes }];
    }
    nodes.push(split);
  }
  const interleaved = Number(intAttribute(node, 'rotary_interleaved') ?? 0);
  const rotate = (input: string, count: number, output: string): onnxProto.onnx.INodeProto => ({
    name: `${output}/RotaryEmbedding`,
    opType: 'RotaryEmbedding',
    domain: 'com.microsoft',
    input: [input, positions, cos, sin],
    output: [output],
    attribute: [
      { name: 'interleaved', type: onnx.AttributeProto.AttributeType.INT, i: interleaved },
      { name: 'num_heads', type: onnx.AttributeProto.AttributeType.INT, i: count },
      ...(2 * halfRotary < headDim
        ? [{ name: 'rotary_embedding_dim', type: onnx.AttributeProto.AttributeType.INT, i: 2 * halfRotary }]
        : []),
    ],
  });
  const [rotatedQuery, rotatedKey] = [`${base}/rotated_query`, `${base}/rotated_key`];
  nodes.push(rotate(query, heads, rotatedQuery), rotate(key, kvHeads, rotatedKey));
  const rest = [...inputs];
  rest[GQA_INPUT.query] = rotatedQuery;
  rest[GQA_INPUT.key] = rotatedKey;
  rest[GQA_INPUT.value] = value;
  rest[GQA_INPUT.cosCache] = '';
  rest[GQA_INPUT.sinCache] = '';
  while (rest.length > 0 && rest[rest.length - 1] === '') rest.pop();
  node.input = rest;
  node.attribute = (node.attribute ?? []).filter((entry) => entry.name !== 'do_rotary' && entry.name !== 'rotary_interleaved');
  return { nodes, constants };
}

/** A node's integer attribute, if set. */
export function intAttribute(node: onnxProto.onnx.INodeProto, name: string): onnxProto.onnx.IAttributeProto['i'] {
  return (node.attribute ?? []).find((entry) => entry.name === name)?.i;
}
