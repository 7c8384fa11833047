import { closeSync, fstatSync, openSync } from 'node:fs';
import onnxProto from 'onnx-proto';
import { exactOnnxInt64 } from './onnx-proto.js';
import { ModelDirError } from './model-dir-error.js';
import { ENTRY, GRAPH, MODEL_GRAPH, nodeTree, TENSOR } from './onnx-file-fields.js';
import { FileReader, WIRE, type Field } from './protobuf-file-reader.js';
import type { OnnxIo } from './types.js';

const { onnx } = onnxProto;

/** A graph input or output as the model file declares it. */
interface ValueInfo {
  name: string;
  /** ONNX TensorProto.DataType (1 float32, 7 int64, 10 float16, 16 bfloat16, ...). */
  elemType: number;
  /** A fixed size, or the symbolic name of a dynamic one. */
  dims: Array<number | string>;
}

const ELEM_TYPE_NAMES: Readonly<Record<number, string>> = {
  1: 'float32',
  6: 'int32',
  7: 'int64',
  9: 'bool',
  10: 'float16',
  11: 'float64',
  16: 'bfloat16',
};
const PAST_KEY = /^past_key_values\.(\d+)\.key$/;
const PAST_KV = /^past_key_values\.\d+\.(key|value)$/;
const INT64 = 7;
const BOOL = 9;

/** The boolean input that picks the branch of a merged decoder (Optimum's `decoder_model_merged.onnx`). */
export const USE_CACHE_BRANCH = 'use_cache_branch';

/**
 * Every graph input the engine feeds besides `past_key_values.*`, with the element type it feeds
 * (onnx-session.ts `#feeds`). A graph that declares any other input, or one of these with another
 * type, would load in onnxruntime and then fail every run, so it is refused here.
 */
const FED_INPUTS: Readonly<Record<string, number>> = {
  input_ids: INT64,
  attention_mask: INT64,
  position_ids: INT64,
  [USE_CACHE_BRANCH]: BOOL,
  num_logits_to_keep: INT64,
};

/**
 * Reads what an ONNX decoder graph declares: inputs, outputs, KV-cache geometry and the features
 * the engine must feed or work around. No onnxruntime needed (the engine is the only place that
 * loads one). Only the graph's inputs, outputs and node op types are read; weights are skipped by
 * seeking past them, so a 500 MB single-file model costs a few reads, not a full decode.
 *
 * @throws ModelDirError naming the file when it is missing, not ONNX, or not a decoder with a KV
 *   cache (`input_ids`, `past_key_values.{i}.key|value` in, `logits`, `present.{i}.key|value` out).
 */
export async function readOnnxIo(onnxPath: string): Promise<OnnxIo> {
  return readOnnxIoSync(onnxPath, onnxPath);
}

/** {@link readOnnxIo}, with errors naming the file as `displayName` (e.g. `onnx/model.onnx`). */
export function readOnnxIoSync(onnxPath: string, displayName: string): OnnxIo {
  let fd: number;
  try {
    fd = openSync(onnxPath, 'r');
  } catch (cause) {
    throw new ModelDirError(displayName, 'file not found', { cause });
  }
  try {
    const graph = scanModel(new FileReader(fd, fstatSync(fd).size, displayName));
    return describeDecoder(graph, displayName);
  } finally {
    closeSync(fd);
  }
}

function describeDecoder(graph: ScannedGraph, file: string): OnnxIo {
  const fail = (problem: string): never => {
    throw new ModelDirError(file, problem);
  };
  const inputs = new Map(graph.inputs.map((input) => [input.name, input]));
  const outputNames = graph.outputs.map((output) => output.name);
  if (!inputs.has('input_ids')) fail('graph has no input_ids input (not a decoder-only language model?)');
  if (!inputs.has('attention_mask')) fail('graph has no attention_mask input (the engine feeds one with every call)');
  for (const input of graph.inputs) checkFedInput(input, fail);
  const logits =
    graph.outputs.find((output) => output.name === 'logits') ?? fail('graph has no logits output (not a language model head?)');
  if (logits.elemType !== 1 && logits.elemType !== 10) {
    fail(`logits element type ${elemTypeName(logits.elemType)} is not supported (float32 or float16)`);
  }

  const layers = [...inputs.keys()].flatMap((name) => {
    const match = PAST_KEY.exec(name);
    return match ? [Number(match[1])] : [];
  });
  if (layers.length === 0) {
    fail('graph has no past_key_values.{i}.key inputs: export it with a KV cache (Optimum task text-generation-with-past)');
  }
  const numLayers = layers.length;
  let shape: { numKvHeads: number; headDim: number; elemType: number } | undefined;
  for (let layer = 0; layer < numLayers; layer++) {
    for (const kind of ['key', 'value']) {
      const pastName = `past_key_values.${layer}.${kind}`;
      const past = inputs.get(pastName) ?? fail(`graph lacks input ${pastName} (layers must be numbered 0..${numLayers - 1})`);
      if (!outputNames.includes(`present.${layer}.${kind}`)) fail(`graph lacks output present.${layer}.${kind}`);
      const [, heads, , headDim] = past.dims;
      if (past.dims.length !== 4 || !isPositive(heads) || !isPositive(headDim)) {
        fail(
          `${pastName} must have shape [batch, num_kv_heads, past_sequence_length, head_dim] with fixed heads and head size, got [${past.dims.join(', ')}]`,
        );
      }
      const current = { numKvHeads: heads as number, headDim: headDim as number, elemType: past.elemType };
      shape ??= current;
      if (current.numKvHeads !== shape.numKvHeads || current.headDim !== shape.headDim || current.elemType !== shape.elemType) {
        fail(`${pastName} differs in shape or type from past_key_values.0.key`);
      }
    }
  }
  const { numKvHeads, headDim, elemType } = shape!;
  const kvDtype = elemType === 1 ? 'float32' : elemType === 10 ? 'float16' : undefined;
  if (kvDtype === undefined) {
    fail(`past_key_values element type ${elemTypeName(elemType)} is not supported (float32 or float16)`);
  }
  const io: OnnxIo = {
    inputNames: graph.inputs.map((input) => input.name),
    outputNames,
    numLayers,
    numKvHeads,
    headDim,
    kvDtype: kvDtype!,
    hasPositionIds: inputs.has('position_ids'),
    hasUseCacheBranch: inputs.has(USE_CACHE_BRANCH),
    hasNumLogitsToKeep: inputs.has('num_logits_to_keep'),
    usesGroupQueryAttention: graph.opTypes.has('GroupQueryAttention'),
    externalDataFiles: [...graph.externalDataFiles],
  };
  const [, , vocabSize] = logits.dims;
  if (logits.dims.length === 3 && isPositive(vocabSize)) io.vocabSize = vocabSize as number;
  return io;
}

/** Refuses an input the engine would not feed, or would feed with another element type. */
function checkFedInput(input: ValueInfo, fail: (problem: string) => never): void {
  // past_key_values.* types are checked with the cache's geometry (float32 or float16, all alike).
  if (PAST_KV.test(input.name)) return;
  const fed = FED_INPUTS[input.name];
  if (fed === undefined) {
    fail(
      `graph input ${input.name} is not one the engine feeds (it feeds ${Object.keys(FED_INPUTS).join(', ')} ` +
        'and past_key_values.{i}.key|value): an export for another runtime?',
    );
  }
  if (input.elemType !== fed) {
    fail(`graph input ${input.name} is ${elemTypeName(input.elemType)}, but the engine feeds it as ${elemTypeName(fed)}`);
  }
}

function elemTypeName(elemType: number): string {
  return ELEM_TYPE_NAMES[elemType] ?? `element type ${elemType}`;
}

function isPositive(dim: number | string | undefined): boolean {
  return typeof dim === 'number' && Number.isInteger(dim) && dim > 0;
}

// --- Reading protobuf fields straight from the file -------------------------------------------

interface ScannedGraph {
  inputs: ValueInfo[];
  outputs: ValueInfo[];
  /** Op types of all nodes, subgraphs (If / Loop branches) included. */
  opTypes: Set<string>;
  /** `location` of every initializer stored as external data. */
  externalDataFiles: Set<string>;
}

function scanModel(reader: FileReader): ScannedGraph {
  let graph: Field | undefined;
  for (const field of reader.fields(0, reader.size)) {
    if (field.number === MODEL_GRAPH && field.wireType === WIRE.bytes) graph = field;
  }
  if (graph === undefined) reader.malformed('no graph in the model');
  const scanned: ScannedGraph = { inputs: [], outputs: [], opTypes: new Set(), externalDataFiles: new Set() };
  const initializers = new Set<string>();
  for (const field of reader.fields(graph.start, graph.end)) {
    if (field.wireType !== WIRE.bytes) continue;
    if (field.number === GRAPH.input || field.number === GRAPH.output) {
      const info = decodeValueInfo(reader.bytes(field.start, field.end - field.start));
      (field.number === GRAPH.input ? scanned.inputs : scanned.outputs).push(info);
    } else if (field.number === GRAPH.node) {
      for (const node of nodeTree(reader, field)) scanned.opTypes.add(node.opType);
    } else if (field.number === GRAPH.initializer) {
      const { name, location } = scanInitializer(reader, field);
      if (name !== undefined) initializers.add(name);
      if (location !== undefined) scanned.externalDataFiles.add(location);
    }
  }
  // Old exports (IR < 4) also list every weight as a graph input; those are not fed by callers.
  scanned.inputs = scanned.inputs.filter((input) => !initializers.has(input.name));
  return scanned;
}

/** An initializer's name and, when its bytes live in an external-data file, that file's location. */
function scanInitializer(reader: FileReader, tensor: Field): { name?: string; location?: string } {
  const found: { name?: string; location?: string } = {};
  for (const field of reader.fields(tensor.start, tensor.end)) {
    if (field.wireType !== WIRE.bytes) continue;
    if (field.number === TENSOR.name) found.name = reader.string(field);
    else if (field.number === TENSOR.externalData) {
      let key: string | undefined;
      let value: string | undefined;
      for (const entry of reader.fields(field.start, field.end)) {
        if (entry.wireType !== WIRE.bytes) continue;
        if (entry.number === ENTRY.key) key = reader.string(entry);
        else if (entry.number === ENTRY.value) value = reader.string(entry);
      }
      if (key === 'location' && value !== undefined) found.location = value;
    }
  }
  return found;
}

function decodeValueInfo(bytes: Uint8Array): ValueInfo {
  exactOnnxInt64();
  const info = onnx.ValueInfoProto.decode(bytes);
  const tensor = info.type?.tensorType;
  return {
    name: info.name ?? '',
    elemType: tensor?.elemType ?? 0,
    dims: (tensor?.shape?.dim ?? []).map((dim) => (dim.dimParam ? dim.dimParam : dim.dimValue != null ? Number(dim.dimValue) : '?')),
  };
}
