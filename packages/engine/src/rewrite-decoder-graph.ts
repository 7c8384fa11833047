/**
 * The load-time rewrite of a decoder graph (onnx-proto only; the session that runs the result is
 * `onnx-session.ts`): new key/value slices as outputs instead of `present.*`, nodes nothing reads
 * removed, logits of the last position only. Why each: docs/engine.md, "KV cache".
 */
import { readFile } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import onnxProto from 'onnx-proto';
import { exactOnnxInt64, readOnnxGraphOnly } from '@sluice/model';
import { orderedKvNames, PAST_INPUT, PRESENT_OUTPUT } from './kv-names.js';
import { appliesRotaryInside, intAttribute, positionIdsInput, rotaryBeforeAttention } from './rotary-before-attention.js';
import { attentionMask, int, plainAttention, type AttentionMask } from './plain-attention.js';
import { inlineCacheBranch } from './inline-cache-branch.js';
import { splitPresentAttention } from './split-present-attention.js';

const { onnx } = onnxProto;

/** A decoder graph rewritten by {@link rewriteDecoderGraph}. */
export interface RewrittenGraph {
  /** The re-encoded graph: weights inside it, or external data in their own files or in the model file itself (`weightsInPlace`). */
  bytes: Uint8Array;
  /** Each layer's new key and value slice outputs, in layer order. */
  newKvNames: string[];
  /**
   * Set when initializers are external data (see {@link RewrittenGraph.bytes}): the folder their
   * locations are relative to, which a session created from the bytes must be told
   * ({@link rewrittenSessionConfig}).
   */
  externalDataFolder?: string;
  /** Whether the graph still runs GroupQueryAttention (which cannot express padded rows). */
  groupQueryAttention: boolean;
  /** Layers whose attention over `present.*` was made to read the past and the new slots separately ({@link splitPresentAttention}). */
  splitAttentionLayers: number;
  /**
   * The logits are each row's at its last real new token (the count of 1s over the new slots of
   * `attention_mask`, minus one), so rows of several prompts may share a call right-padded
   * ({@link lastPositionLogits}). False: at the last new slot, or every position's.
   */
  lastRealTokenLogits: boolean;
}

/** Graph outputs added for GroupQueryAttention layers: the step's new key/value in [batch, kvHeads, new, headDim]. */
const NEW_KV_OUTPUT = (layer: number, kind: string): string => `sluice_new_kv.${layer}.${kind}`;

/**
 * Reads the model and, where every layer's step keys/values can be read off the graph, returns it
 * re-encoded with those new slices ([rows, kvHeads, newTokens, headDim]) as graph outputs in place
 * of `present.*` (names in layer order, key then value). Two forms are recognized:
 * - Optimum's plain ops: `present.{i}.key|value` is a Concat along the slot axis of
 *   `past_key_values.{i}.key|value` and the new slice (the Concat's second input);
 * - onnxruntime's GroupQueryAttention (`com.microsoft`) with `present.{i}.*` as its outputs 1 and 2,
 *   the past as inputs 3 and 4, and separate key/value inputs already rotated (`do_rotary` off):
 *   those inputs are [batch, new, kvHeads·headDim], so a Reshape and a Transpose are added. A node
 *   that rotates inside (`do_rotary` 1, q/k/v packed or not: onnxruntime-genai's CPU exports) is
 *   first given its rotary as nodes before it, at the positions of a `position_ids` input the
 *   rewritten graph then takes ({@link rotaryBeforeAttention}).
 * A merged decoder (the decoder in an `If` on `use_cache_branch`) is first replaced by its with-past
 * branch ({@link inlineCacheBranch}).
 * Dropping `present.*` from the outputs lets onnxruntime prune what only fed them: a graph that
 * attends over the past and the new slice separately (the generator's `plain` form) then never
 * copies the cache; an export that attends over the Concat (Optimum's) is first made to read the past
 * and the new slots separately ({@link splitPresentAttention}). GroupQueryAttention still
 * writes its present internally (onnxruntime-node would copy a pre-bound shared buffer back out
 * whole, see docs/engine.md), unless `decomposeGroupQueryAttention` replaces it by the plain form's
 * attention ops ({@link plainAttention}; EngineOptions.gqaAttention says what that trades). Otherwise
 * (another pattern) undefined: the engine then fetches `present.*`.
 *
 * Weights in external-data files (`model.onnx_data`: every export past protobuf's 2 GB, and smaller
 * ones such as Qwen2.5-0.5B's) are not read here: their initializers keep naming their files. Those
 * inside the model file are read and re-encoded with the graph (the file, its re-encoding and
 * onnxruntime's copy in memory at once: about three times the model's size at the peak), unless
 * `weightsInPlace`: then only the graph is read and they become external data naming the model file
 * itself at the offset where their bytes lie (`readOnnxGraphOnly`; the tables a Gather reads stay
 * inside). Either way `externalDataFolder` says where a session created from the returned bytes finds
 * them ({@link rewrittenSessionConfig}). EngineOptions.weightsInPlace says what each costs.
 */
export async function rewriteDecoderGraph(
  modelPath: string,
  options: { decomposeGroupQueryAttention?: boolean; weightsInPlace?: boolean } = {},
): Promise<RewrittenGraph | undefined> {
  exactOnnxInt64();
  let model: onnxProto.onnx.ModelProto;
  try {
    model = onnx.ModelProto.decode(options.weightsInPlace === true ? readOnnxGraphOnly(modelPath) : await readFile(modelPath));
  } catch {
    return undefined;
  }
  const graph = model.graph;
  if (graph == null) return undefined;
  const pastNames = orderedKvNames(
    (graph.input ?? []).map((input) => input.name ?? ''),
    PAST_INPUT,
  );
  const presentNames = orderedKvNames(
    (graph.output ?? []).map((output) => output.name ?? ''),
    PRESENT_OUTPUT,
  );
  if (pastNames.length === 0 || pastNames.length !== presentNames.length) return undefined;
  if (inlineCacheBranch(graph, pastNames) === 'refused') return undefined;
  const producers = new Map<string, onnxProto.onnx.INodeProto>();
  for (const node of graph.node ?? []) for (const output of node.output ?? []) producers.set(output, node);
  const graphNames = new Set([...(graph.input ?? []), ...(graph.output ?? [])].map((value) => value.name ?? ''));
  const pastInfo = new Map((graph.input ?? []).map((input) => [input.name ?? '', input]));
  const headDim = Number(pastInfo.get(pastNames[0]!)?.type?.tensorType?.shape?.dim?.[3]?.dimValue ?? NaN);
  const newKvNames: string[] = [];
  const constants: onnxProto.onnx.ITensorProto[] = [];
  // Nodes to run right before a node: the rotary taken out of GroupQueryAttention, its new key/value, the shared mask.
  const before = new Map<onnxProto.onnx.INodeProto, onnxProto.onnx.INodeProto[]>();
  const initializerByName = new Map((graph.initializer ?? []).map((tensor) => [tensor.name ?? '', tensor]));
  const defaultOpset = Number(model.opsetImport?.find((entry) => (entry.domain ?? '') === '')?.version ?? 1);
  for (const node of new Set(presentNames.map((name) => producers.get(name)))) {
    if (node === undefined || !appliesRotaryInside(node)) continue;
    const taken = rotaryBeforeAttention(node, positionIdsInput(graph), headDim, initializerByName, defaultOpset);
    if (taken === undefined) return undefined;
    before.set(node, taken.nodes);
    constants.push(...taken.constants);
  }
  for (let k = 0; k < presentNames.length; k++) {
    const node = producers.get(presentNames[k]!);
    const inputs = node?.input ?? [];
    const attribute = (name: string) => (node?.attribute ?? []).find((entry) => entry.name === name);
    const layer = Math.floor(k / 2);
    const kind = k % 2 === 0 ? 'key' : 'value';
    if (node?.opType === 'Concat' && (node.domain ?? '') === '' && inputs.length === 2 && inputs[0] === pastNames[k]) {
      const axisValue = Number(attribute('axis')?.i ?? NaN);
      if (axisValue !== 2 && axisValue !== -2) return undefined;
      const slice = inputs[1]!;
      if (slice === '' || graphNames.has(slice)) return undefined;
      newKvNames.push(slice);
    } else if (node?.opType === 'GroupQueryAttention' && node.domain === 'com.microsoft') {
      const at = kind === 'key' ? 1 : 2;
      if (node.output?.[at] !== presentNames[k] || inputs[at + 2] !== pastNames[k] || Number(attribute('do_rotary')?.i ?? 0) !== 0)
        return undefined;
      const slice = inputs[at];
      const kvHeads = Number(attribute('kv_num_heads')?.i ?? NaN);
      if (slice === undefined || slice === '' || !Number.isInteger(kvHeads) || !Number.isInteger(headDim)) return undefined;
      // [B, S, kvHeads·headDim] → [B, kvHeads, S, headDim].
      const name = NEW_KV_OUTPUT(layer, kind);
      const shapeName = `${name}/shape`;
      constants.push({ name: shapeName, dims: [4], dataType: onnx.TensorProto.DataType.INT64, int64Data: [0, 0, kvHeads, headDim] });
      const first = before.get(node) ?? [];
      before.set(node, first);
      first.push(
        { name: `${name}/Reshape`, opType: 'Reshape', input: [slice, shapeName], output: [`${name}/4d`] },
        {
          name: `${name}/Transpose`,
          opType: 'Transpose',
          input: [`${name}/4d`],
          output: [name],
          attribute: [{ name: 'perm', type: onnx.AttributeProto.AttributeType.INTS, ints: [0, 2, 1, 3] }],
        },
      );
      newKvNames.push(name);
    } else {
      return undefined;
    }
  }
  const elemType = pastInfo.get(pastNames[0]!)?.type?.tensorType?.elemType ?? onnx.TensorProto.DataType.FLOAT;
  // With `decomposeGroupQueryAttention`, GroupQueryAttention (its new key/value now read off above)
  // is replaced by the plain form's attention (plain-attention.ts).
  const replaced = new Map<onnxProto.onnx.INodeProto, onnxProto.onnx.INodeProto[]>();
  let mask: AttentionMask | undefined;
  const graphInputs = new Set((graph.input ?? []).map((input) => input.name ?? ''));
  for (let layer = 0; options.decomposeGroupQueryAttention === true && layer < presentNames.length / 2; layer++) {
    const node = producers.get(presentNames[2 * layer]!);
    if (node?.opType !== 'GroupQueryAttention' || !inPlainOps(node, defaultOpset, elemType, graphInputs)) continue;
    if (mask === undefined) {
      const made = attentionMask('attention_mask', 'input_ids');
      mask = made.mask;
      before.get(node)?.push(...made.nodes);
      constants.push(...made.constants);
    }
    const heads = Number(intAttribute(node, 'num_heads'));
    const kvHeads = Number(intAttribute(node, 'kv_num_heads'));
    const scale = Number((node.attribute ?? []).find((entry) => entry.name === 'scale')?.f ?? 0) || 1 / Math.sqrt(headDim);
    const inputs = node.input ?? [];
    const attention = plainAttention(
      `sluice_attention/${layer}`,
      {
        query: inputs[0]!,
        newKey: newKvNames[2 * layer]!,
        newValue: newKvNames[2 * layer + 1]!,
        pastKey: inputs[3]!,
        pastValue: inputs[4]!,
      },
      { heads, kvHeads, headDim, scale },
      mask,
      node.output![0]!,
    );
    replaced.set(node, attention.nodes);
    constants.push(...attention.constants);
  }
  // An export that attends over present.* (Optimum's) reads the past and the new slots separately instead.
  let splitAttentionLayers = 0;
  const concats = Array.from({ length: presentNames.length / 2 }, (_, layer) => ({
    key: producers.get(presentNames[2 * layer]!)!,
    value: producers.get(presentNames[2 * layer + 1]!)!,
  })).filter(({ key, value }) => key.opType === 'Concat' && value.opType === 'Concat');
  const kvHeads = Number(pastInfo.get(pastNames[0]!)?.type?.tensorType?.shape?.dim?.[1]?.dimValue ?? NaN);
  if (concats.length === presentNames.length / 2 && Number.isInteger(kvHeads) && Number.isInteger(headDim)) {
    const split = splitPresentAttention(graph.node ?? [], concats, { kvHeads, headDim });
    for (const [node, nodes] of split.replaced) replaced.set(node, nodes);
    splitAttentionLayers = split.replaced.size;
    constants.push(...split.constants);
  }
  const presents = new Set(presentNames);
  graph.output = [
    ...(graph.output ?? []).filter((output) => !presents.has(output.name ?? '')),
    ...newKvNames.map((name) => onnx.ValueInfoProto.create({ name, type: { tensorType: { elemType } } })),
  ];
  // Added nodes go right before the node they were made for, so the list stays in topological order.
  const nodes: onnxProto.onnx.INodeProto[] = (graph.node ?? []).flatMap((node) => [
    ...(before.get(node) ?? []).map((entry) => onnx.NodeProto.create(entry)),
    ...(replaced.get(node)?.map((entry) => onnx.NodeProto.create(entry)) ?? [node]),
  ]);
  const initializers = new Set((graph.initializer ?? []).map((tensor) => tensor.name ?? ''));
  const byMask = defaultOpset >= 13 && graphInputs.has('attention_mask') && graphInputs.has('input_ids');
  const lastOnly = lastPositionLogits(nodes, initializers, byMask);
  if (lastOnly !== undefined) {
    nodes.push(...lastOnly.nodes);
    constants.push(...lastOnly.constants);
  }
  graph.node = withoutDeadNodes(nodes, graph.output);
  graph.initializer = [...(graph.initializer ?? []), ...constants.map((tensor) => onnx.TensorProto.create(tensor))];
  const external = (graph.initializer ?? []).some((tensor) => tensor.dataLocation === onnx.TensorProto.DataLocation.EXTERNAL);
  return {
    bytes: onnx.ModelProto.encode(model).finish(),
    newKvNames,
    groupQueryAttention: graph.node.some((node) => node.opType === 'GroupQueryAttention'),
    splitAttentionLayers,
    lastRealTokenLogits: lastOnly !== undefined && byMask,
    ...(external ? { externalDataFolder: dirname(resolve(modelPath)) } : {}),
  };
}

/**
 * The onnxruntime session config entries (`extra.session`) a session created from
 * {@link RewrittenGraph.bytes} needs: where its external weights are (without the folder onnxruntime
 * refuses: "External data path for model loaded from bytes escapes working directory").
 */
export function rewrittenSessionConfig(rewritten: Pick<RewrittenGraph, 'externalDataFolder'>): Record<string, string> {
  return rewritten.externalDataFolder === undefined ? {} : { model_external_initializers_file_folder_path: rewritten.externalDataFolder };
}

/** Ops between the final hidden state and `logits` (the lm_head and its reshapes). */
const LM_HEAD_OPS = new Set(['MatMul', 'Gemm', 'Reshape', 'Cast', 'Identity']);

/**
 * Logits of the last position only: the engine samples nothing else, and a prefill chunk's
 * logits are [chunk, vocab] (a 512-token chunk at a 150k vocabulary is ~300 MB, all but one row
 * unused). Walks back from `logits` through the lm_head ({@link LM_HEAD_OPS}, following the
 * non-initializer input) to the hidden state [batch, positions, hidden] that feeds it, and makes
 * every reader of that hidden state read one position of each row instead. `byMask` (opset 13 or
 * later, `attention_mask` and `input_ids` inputs): each row's last real new token, at the count of
 * 1s over the new slots of `attention_mask` minus one (a GatherND with one batch axis), so a call
 * may carry prompts right-padded, each row's real tokens and keys at the indices they have alone
 * (onnxruntime's softmax sums by index: docs/engine.md, "Batch invariance"); every call the engine
 * makes otherwise has no padding among its new tokens, where that count reads the last slot. Else
 * the last slot (a Slice on axis 1). Mutates `nodes`' inputs and returns the nodes to add, or
 * undefined when the pattern is not there. Graphs whose logits reshape takes its shape from
 * `input_ids` would then fail to run; the generated ones take it from the hidden state, Optimum's
 * MatMul head needs no reshape.
 */
function lastPositionLogits(
  nodes: onnxProto.onnx.INodeProto[],
  initializers: ReadonlySet<string>,
  byMask: boolean,
): { nodes: onnxProto.onnx.INodeProto[]; constants: onnxProto.onnx.ITensorProto[] } | undefined {
  const producers = new Map<string, onnxProto.onnx.INodeProto>();
  for (const node of nodes) for (const output of node.output ?? []) producers.set(output, node);
  let at = 'logits';
  const head = new Set<onnxProto.onnx.INodeProto>();
  for (let depth = 0; depth < 8; depth++) {
    const node = producers.get(at);
    if (node === undefined || (node.domain ?? '') !== '' || !LM_HEAD_OPS.has(node.opType ?? '')) break;
    const next = (node.input ?? []).find((input) => input !== '' && !initializers.has(input) && producers.has(input));
    if (next === undefined) return undefined;
    head.add(node);
    at = next;
  }
  if (at === 'logits' || producers.get(at) === undefined) return undefined;
  // Only when the head (and Shape nodes sizing its output) are all that read the hidden state.
  const readers = nodes.filter((node) => (node.input ?? []).includes(at));
  if (!readers.every((node) => head.has(node) || node.opType === 'Shape')) return undefined;
  // Every reader of the hidden state (the head, and shape ops that size the logits) reads the last position.
  const hidden = at;
  const last = `${hidden}/sluice_last_position`;
  const name = (suffix: string) => `${last}/${suffix}`;
  for (const node of nodes) node.input = (node.input ?? []).map((input) => (input === hidden ? last : input));
  const int64 = (suffix: string, value: number | string): onnxProto.onnx.ITensorProto => ({
    name: name(suffix),
    dims: [1],
    dataType: onnx.TensorProto.DataType.INT64,
    int64Data: [value],
  });
  const node = (opType: string, input: string[], output: string, attribute: onnxProto.onnx.IAttributeProto[] = []) =>
    onnx.NodeProto.create({ name: `${output}/${opType}`, opType, input, output: [output], attribute });
  const end = int64('end', '9223372036854775807');
  const one = int64('one', 1);
  if (!byMask) {
    return {
      nodes: [node('Slice', [hidden, name('minus_one'), name('end'), name('one')], last)],
      constants: [int64('minus_one', -1), end, one],
    };
  }
  // The new slots' count S, the mask's last S columns [B, S], its 1s per row [B, 1], minus one: each
  // row's index into [B, S, H], one [H] a row, [B, 1, H] again.
  return {
    nodes: [
      node('Shape', ['input_ids'], name('ids_shape')),
      node('Slice', [name('ids_shape'), name('one'), name('two')], name('new_slots')),
      node('Neg', [name('new_slots')], name('from_end')),
      node('Slice', ['attention_mask', name('from_end'), name('end'), name('one')], name('new_mask')),
      node('ReduceSum', [name('new_mask'), name('one')], name('real'), [int('keepdims', 1)]),
      node('Sub', [name('real'), name('one')], name('index')),
      node('GatherND', [hidden, name('index')], name('picked'), [int('batch_dims', 1)]),
      node('Unsqueeze', [name('picked'), name('one')], last),
    ],
    constants: [end, one, int64('two', 2)],
  };
}

/**
 * The nodes that some graph output still needs. onnxruntime 1.30 runs a node whose outputs nobody
 * reads (measured: the dropped `present.*` Concats still ran, ~15 ms of a 42 ms step at batch 32,
 * past 256), so they are removed here. Names read inside subgraphs (If/Loop bodies) count as read.
 */
function withoutDeadNodes(
  nodes: onnxProto.onnx.INodeProto[],
  outputs: readonly onnxProto.onnx.IValueInfoProto[],
): onnxProto.onnx.INodeProto[] {
  const subgraphInputs = (graph: onnxProto.onnx.IGraphProto | null | undefined): string[] =>
    (graph?.node ?? []).flatMap((node) => [
      ...(node.input ?? []),
      ...(node.attribute ?? []).flatMap((a) => [a.g, ...(a.graphs ?? [])].flatMap(subgraphInputs)),
    ]);
  let live = nodes;
  for (;;) {
    const read = new Set(outputs.map((output) => output.name ?? ''));
    for (const node of live) {
      for (const input of node.input ?? []) read.add(input);
      for (const attribute of node.attribute ?? [])
        for (const name of [attribute.g, ...(attribute.graphs ?? [])].flatMap(subgraphInputs)) read.add(name);
    }
    const next = live.filter((node) => (node.output ?? []).some((output) => output !== '' && read.has(output)));
    if (next.length === live.length) return live;
    live = next;
  }
}

/**
 * True when a GroupQueryAttention node (rotary before it, q/k/v unpacked: inputs q, k, v, past key,
 * past value, seqlens_k, total length and nothing more) computes exactly what {@link plainAttention}
 * writes: no sliding window, softcap, smooth softmax or extra output, a float32 cache, opset 13 or
 * later, and the graph's `attention_mask` and `input_ids` to build the mask from.
 */
function inPlainOps(node: onnxProto.onnx.INodeProto, defaultOpset: number, elemType: number, graphInputs: ReadonlySet<string>): boolean {
  const inputs = node.input ?? [];
  const window = Number(intAttribute(node, 'local_window_size') ?? -1); // -1: no sliding window
  const off = (name: string) => Number(intAttribute(node, name) ?? 0) === 0;
  const softcap = Number((node.attribute ?? []).find((entry) => entry.name === 'softcap')?.f ?? 0);
  return (
    defaultOpset >= 13 &&
    elemType === Number(onnx.TensorProto.DataType.FLOAT) &&
    graphInputs.has('attention_mask') &&
    graphInputs.has('input_ids') &&
    inputs.length <= 7 &&
    inputs.slice(0, 5).every((input) => input !== '') &&
    (node.output ?? []).length <= 3 &&
    window === -1 &&
    softcap === 0 &&
    off('smooth_softmax') &&
    off('qk_output') &&
    Number.isInteger(Number(intAttribute(node, 'num_heads'))) &&
    Number.isInteger(Number(intAttribute(node, 'kv_num_heads')))
  );
}
