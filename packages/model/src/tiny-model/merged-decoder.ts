import onnxProto from 'onnx-proto';
import { USE_CACHE_BRANCH } from '../onnx-io.js';
import { exactOnnxInt64 } from '../onnx-proto.js';

const { onnx } = onnxProto;

/**
 * Rewrites a decoder as Optimum's `merge_decoders` lays out `decoder_model_merged.onnx` (the form of
 * many transformers.js-era repos on the Hub): the graph's nodes move into the two branches of one
 * `If` on a `use_cache_branch` input ([1], bool) — `then_branch` "with_past", `else_branch`
 * "no_past" — whose outputs are named as the graph's; weights stay initializers of the outer graph,
 * while scalar and one-dimensional int32/int64 initializers stay in each branch (as Optimum keeps
 * them there). Both branches are this graph: Optimum's no-past branch is a second export that takes
 * no past, which gives the same outputs as this one fed an empty past (what callers of a merged
 * decoder pass with `use_cache_branch` false).
 */
export function asMergedDecoder(model: Uint8Array): Uint8Array {
  exactOnnxInt64();
  const decoded = onnx.ModelProto.decode(model);
  const graph = decoded.graph;
  if (graph == null) throw new Error('model has no graph');
  const small = (tensor: onnxProto.onnx.ITensorProto): boolean => {
    const dims = tensor.dims ?? [];
    const int = tensor.dataType === onnx.TensorProto.DataType.INT64 || tensor.dataType === onnx.TensorProto.DataType.INT32;
    return dims.length === 0 || (dims.length === 1 && int);
  };
  const initializers = graph.initializer ?? [];
  const branch = (name: string): onnxProto.onnx.IGraphProto => ({
    name,
    node: graph.node ?? [],
    initializer: initializers.filter(small),
    output: graph.output ?? [],
  });
  const attribute = (name: string, branchName: string): onnxProto.onnx.IAttributeProto => ({
    name,
    type: onnx.AttributeProto.AttributeType.GRAPH,
    g: branch(branchName),
  });
  graph.node = [
    onnx.NodeProto.create({
      name: 'optimum::if',
      opType: 'If',
      input: [USE_CACHE_BRANCH],
      output: (graph.output ?? []).map((output) => output.name ?? ''),
      attribute: [attribute('then_branch', 'with_past'), attribute('else_branch', 'no_past')],
    }),
  ];
  graph.initializer = initializers.filter((tensor) => !small(tensor));
  graph.input = [
    ...(graph.input ?? []),
    onnx.ValueInfoProto.create({
      name: USE_CACHE_BRANCH,
      type: { tensorType: { elemType: onnx.TensorProto.DataType.BOOL, shape: { dim: [{ dimValue: 1 }] } } },
    }),
  ];
  graph.name = 'merged';
  return onnx.ModelProto.encode(decoded).finish();
}
