/**
 * The only file that imports onnxruntime-node: loads the model, reads what its graph declares and
 * runs one call over a left-padded batch.
 */
import { readFile } from 'node:fs/promises';
import * as ort from 'onnxruntime-node';
import onnxProto from 'onnx-proto';
import { EngineError } from './engine-error.js';
import type { KvBatch, KvData, KvShape } from './kv-batch.js';
import type { PackedInputs } from './pack-inputs.js';
import type { ExecutionProvider } from './types.js';

export interface OnnxSessionOptions {
  modelPath: string;
  executionProvider: ExecutionProvider;
  /** 0 = onnxruntime's default. */
  intraOpThreads: number;
  /** 0 = onnxruntime's default. */
  interOpThreads: number;
  /** Add new key/value slice outputs when the graph allows (default true; false forces the present.* path). */
  newKvOutputs?: boolean;
}

/** What the graph declares, read from the session's input and output metadata. */
export interface SessionIo {
  kv: KvShape;
  vocabSize: number | undefined;
  hasPositionIds: boolean;
  hasUseCacheBranch: boolean;
  hasNumLogitsToKeep: boolean;
}

export interface ModelOutputs {
  /** [rows, positions, vocabSize], float32 (float16 logits are widened). */
  logits: Float32Array;
  /** Logit positions per row: 1 when the graph keeps only the last one, else the call's new tokens. */
  positions: number;
  vocabSize: number;
  /** present.* in layer order (key, value), [rows, heads, pastLength + newTokens, headDim]. */
  present: KvData[];
}

export interface DecodeOutputs {
  /** [rows, positions, vocabSize], float32. */
  logits: Float32Array;
  positions: number;
  vocabSize: number;
  /** The call's new key/value slices in layer order (key, value), [rows, heads, newTokens, headDim]. */
  newKv: KvData[];
}

const PAST_INPUT = /^past_key_values\.(\d+)\.(key|value)$/;
const PRESENT_OUTPUT = /^present\.(\d+)\.(key|value)$/;

export class OnnxSession {
  readonly io: SessionIo;
  readonly #session: ort.InferenceSession;
  readonly #pastNames: string[];
  readonly #presentNames: string[];
  /** Graph outputs holding each layer's new key/value slice (added at load), or undefined. */
  readonly #newKvNames: string[] | undefined;

  private constructor(session: ort.InferenceSession, newKvNames: string[] | undefined) {
    this.#session = session;
    this.#pastNames = orderedKvNames(session.inputNames, PAST_INPUT);
    this.#presentNames = orderedKvNames(session.outputNames, PRESENT_OUTPUT);
    this.#newKvNames = newKvNames !== undefined && newKvNames.every((name) => session.outputNames.includes(name)) ? newKvNames : undefined;
    // A rewritten graph returns the new slices instead of present.* (see withNewKvOutputs).
    const kvOutputs = this.#newKvNames?.length ?? this.#presentNames.length;
    if (this.#pastNames.length === 0 || this.#pastNames.length !== kvOutputs) {
      throw new EngineError(
        'internal',
        'The model must take past_key_values.{i}.key/value and return present.{i}.key/value (a decoder exported with past).',
      );
    }
    const pastMeta = session.inputMetadata.find((meta) => meta.name === this.#pastNames[0]);
    const logitsMeta = session.outputMetadata.find((meta) => meta.name === 'logits');
    if (pastMeta === undefined || !pastMeta.isTensor || logitsMeta === undefined || !logitsMeta.isTensor) {
      throw new EngineError('internal', 'The model declares no tensor past_key_values.0.key or logits.');
    }
    const [, heads, , headDim] = pastMeta.shape;
    if (typeof heads !== 'number' || typeof headDim !== 'number') {
      throw new EngineError('internal', `past_key_values.0.key must have fixed head count and head size, got [${pastMeta.shape.join(', ')}].`);
    }
    if (pastMeta.type !== 'float32' && pastMeta.type !== 'float16') {
      throw new EngineError('internal', `Unsupported KV cache type ${pastMeta.type}.`);
    }
    const vocab = logitsMeta.shape[2];
    this.io = {
      kv: { numLayers: this.#pastNames.length / 2, numKvHeads: heads, headDim, dtype: pastMeta.type },
      vocabSize: typeof vocab === 'number' ? vocab : undefined,
      hasPositionIds: session.inputNames.includes('position_ids'),
      hasUseCacheBranch: session.inputNames.includes('use_cache_branch'),
      hasNumLogitsToKeep: session.inputNames.includes('num_logits_to_keep'),
    };
  }

  static async create(options: OnnxSessionOptions): Promise<OnnxSession> {
    const { executionProvider } = options;
    const sessionOptions: ort.InferenceSession.SessionOptions = {
      executionProviders: [executionProvider],
      graphOptimizationLevel: 'all',
      executionMode: 'sequential',
      logSeverityLevel: 3,
    };
    if (options.intraOpThreads > 0) sessionOptions.intraOpNumThreads = options.intraOpThreads;
    if (options.interOpThreads > 0) sessionOptions.interOpNumThreads = options.interOpThreads;
    if (executionProvider !== 'cpu') {
      const backend = ort.listSupportedBackends().find((candidate) => candidate.name === executionProvider);
      if (backend === undefined) {
        throw new EngineError(
          'provider_unavailable',
          `Execution provider '${executionProvider}' is not built into this onnxruntime-node (${process.platform}-${process.arch}).`,
        );
      }
    }
    let session: ort.InferenceSession;
    let newKvNames: string[] | undefined;
    try {
      const rewritten = options.newKvOutputs === false ? undefined : await withNewKvOutputs(options.modelPath);
      newKvNames = rewritten?.newKvNames;
      session = rewritten === undefined
        ? await ort.InferenceSession.create(options.modelPath, sessionOptions)
        : await ort.InferenceSession.create(rewritten.bytes, sessionOptions);
    } catch (cause) {
      if (executionProvider === 'cpu') {
        throw new EngineError('internal', `Could not load ${options.modelPath}: ${errorText(cause)}`, { cause });
      }
      throw new EngineError(
        'provider_unavailable',
        `Execution provider '${executionProvider}' is unavailable on this machine: ${errorText(cause)}` +
          (executionProvider === 'cuda'
            ? ' (install onnxruntime-node with ONNXRUNTIME_NODE_INSTALL=cuda12 on a machine with CUDA 12 and an NVIDIA GPU)'
            : ''),
        { cause },
      );
    }
    return new OnnxSession(session, newKvNames);
  }

  /**
   * True when the graph was rewritten to output each layer's new key/value slice instead of
   * `present.*`, so every call fetches those instead of the whole cache ({@link runNewKv}).
   */
  get outputsNewKv(): boolean {
    return this.#newKvNames !== undefined;
  }

  /**
   * One forward pass fetching only logits and the new key/value slices (requires
   * {@link outputsNewKv}): onnxruntime-node then copies O(rows × newTokens) KV out, not the cache.
   */
  async runNewKv(inputs: PackedInputs, past: { data: readonly KvData[] }): Promise<DecodeOutputs> {
    const names = this.#newKvNames;
    if (names === undefined) throw new EngineError('internal', 'The session has no new key/value outputs.');
    const { kv, ...outputs } = await this.#runFetching(inputs, past, names);
    return { ...outputs, newKv: kv };
  }

  /**
   * One forward pass: new tokens of every row on top of the batch's cache, fetching `present.*`
   * (only without {@link outputsNewKv}: the rewritten graph no longer returns them).
   */
  async run(inputs: PackedInputs, past: { data: readonly KvData[] }): Promise<ModelOutputs> {
    if (this.#newKvNames !== undefined) throw new EngineError('internal', 'The session returns new key/value slices, not present.*.');
    const { kv, ...outputs } = await this.#runFetching(inputs, past, this.#presentNames);
    return { ...outputs, present: kv };
  }

  /** Runs the model fetching the logits and the named key/value outputs, in that order. */
  async #runFetching(
    inputs: PackedInputs,
    past: { data: readonly KvData[] },
    kvNames: readonly string[],
  ): Promise<{ logits: Float32Array; positions: number; vocabSize: number; kv: KvData[] }> {
    const results = await this.#session.run(this.#feeds(inputs, past), ['logits', ...kvNames]);
    const logits = results['logits'];
    if (logits === undefined) throw new EngineError('internal', 'The model returned no logits.');
    const [, positions, vocabSize] = logits.dims;
    return {
      logits: toFloat32(logits),
      positions: positions ?? 1,
      vocabSize: vocabSize ?? 0,
      kv: kvNames.map((name) => {
        const tensor = results[name];
        if (tensor === undefined) throw new EngineError('internal', `The model returned no ${name}.`);
        return tensor.data as KvData;
      }),
    };
  }

  #feeds(inputs: PackedInputs, past: { data: readonly KvData[] }): Record<string, ort.Tensor> {
    const { rows, newTokens, pastLength } = inputs;
    const { numKvHeads, headDim, dtype } = this.io.kv;
    const feeds: Record<string, ort.Tensor> = {
      input_ids: new ort.Tensor('int64', inputs.inputIds, [rows, newTokens]),
      attention_mask: new ort.Tensor('int64', inputs.attentionMask, [rows, pastLength + newTokens]),
    };
    if (this.io.hasPositionIds) feeds['position_ids'] = new ort.Tensor('int64', inputs.positionIds, [rows, newTokens]);
    if (this.io.hasUseCacheBranch) feeds['use_cache_branch'] = new ort.Tensor('bool', new Uint8Array([pastLength > 0 ? 1 : 0]), [1]);
    if (this.io.hasNumLogitsToKeep) feeds['num_logits_to_keep'] = new ort.Tensor('int64', new BigInt64Array([1n]), []);
    const pastDims = [rows, numKvHeads, pastLength, headDim];
    this.#pastNames.forEach((name, k) => {
      feeds[name] = new ort.Tensor(dtype, past.data[k]!, pastDims);
    });
    return feeds;
  }

  async dispose(): Promise<void> {
    await this.#session.release();
  }
}

const { onnx } = onnxProto;

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
 *   those inputs are [batch, new, kvHeads·headDim], so a Reshape and a Transpose are added.
 * Dropping `present.*` from the outputs lets onnxruntime prune what only fed them: a graph that
 * attends over the past and the new slice separately (the generator's `plain` form) then never
 * copies the cache; Optimum's form still concatenates for attention. GroupQueryAttention still
 * writes its present internally (onnxruntime-node would copy a pre-bound shared buffer back out
 * whole, see docs/engine.md). Otherwise (another pattern, rotary inside GroupQueryAttention, or
 * weights in an external-data file, which a session created from bytes could not locate)
 * undefined: the engine then fetches `present.*`.
 */
async function withNewKvOutputs(modelPath: string): Promise<{ bytes: Uint8Array; newKvNames: string[] } | undefined> {
  let model: onnxProto.onnx.ModelProto;
  try {
    model = onnx.ModelProto.decode(await readFile(modelPath));
  } catch {
    return undefined;
  }
  const graph = model.graph;
  if (graph == null) return undefined;
  if ((graph.initializer ?? []).some((tensor) => tensor.dataLocation === onnx.TensorProto.DataLocation.EXTERNAL)) return undefined;
  const pastNames = orderedKvNames((graph.input ?? []).map((input) => input.name ?? ''), PAST_INPUT);
  const presentNames = orderedKvNames((graph.output ?? []).map((output) => output.name ?? ''), PRESENT_OUTPUT);
  if (pastNames.length === 0 || pastNames.length !== presentNames.length) return undefined;
  const producers = new Map<string, onnxProto.onnx.INodeProto>();
  for (const node of graph.node ?? []) for (const output of node.output ?? []) producers.set(output, node);
  const graphNames = new Set([...(graph.input ?? []), ...(graph.output ?? [])].map((value) => value.name ?? ''));
  const pastInfo = new Map((graph.input ?? []).map((input) => [input.name ?? '', input]));
  const headDim = Number(pastInfo.get(pastNames[0]!)?.type?.tensorType?.shape?.dim?.[3]?.dimValue ?? NaN);
  const newKvNames: string[] = [];
  const added: onnxProto.onnx.INodeProto[] = [];
  const constants: onnxProto.onnx.ITensorProto[] = [];
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
      if (node.output?.[at] !== presentNames[k] || inputs[at + 2] !== pastNames[k] || Number(attribute('do_rotary')?.i ?? 0) !== 0) return undefined;
      const slice = inputs[at];
      const kvHeads = Number(attribute('kv_num_heads')?.i ?? NaN);
      if (slice === undefined || slice === '' || !Number.isInteger(kvHeads) || !Number.isInteger(headDim)) return undefined;
      // [B, S, kvHeads·headDim] → [B, kvHeads, S, headDim].
      const name = NEW_KV_OUTPUT(layer, kind);
      const shapeName = `${name}/shape`;
      constants.push({ name: shapeName, dims: [4], dataType: onnx.TensorProto.DataType.INT64, int64Data: [0, 0, kvHeads, headDim] });
      added.push(
        { name: `${name}/Reshape`, opType: 'Reshape', input: [slice, shapeName], output: [`${name}/4d`] },
        { name: `${name}/Transpose`, opType: 'Transpose', input: [`${name}/4d`], output: [name], attribute: [{ name: 'perm', type: onnx.AttributeProto.AttributeType.INTS, ints: [0, 2, 1, 3] }] },
      );
      newKvNames.push(name);
    } else {
      return undefined;
    }
  }
  const elemType = pastInfo.get(pastNames[0]!)?.type?.tensorType?.elemType ?? onnx.TensorProto.DataType.FLOAT;
  const presents = new Set(presentNames);
  graph.output = [
    ...(graph.output ?? []).filter((output) => !presents.has(output.name ?? '')),
    ...newKvNames.map((name) => onnx.ValueInfoProto.create({ name, type: { tensorType: { elemType } } })),
  ];
  const nodes = [...(graph.node ?? []), ...added.map((node) => onnx.NodeProto.create(node))];
  const initializers = new Set((graph.initializer ?? []).map((tensor) => tensor.name ?? ''));
  const lastOnly = lastPositionLogits(nodes, initializers);
  if (lastOnly !== undefined) {
    nodes.push(lastOnly.node);
    constants.push(...lastOnly.constants);
  }
  graph.node = withoutDeadNodes(nodes, graph.output);
  graph.initializer = [...(graph.initializer ?? []), ...constants.map((tensor) => onnx.TensorProto.create(tensor))];
  return { bytes: onnx.ModelProto.encode(model).finish(), newKvNames };
}

/** Ops between the final hidden state and `logits` (the lm_head and its reshapes). */
const LM_HEAD_OPS = new Set(['MatMul', 'Gemm', 'Reshape', 'Cast', 'Identity']);

/**
 * Logits of the last position only: the engine samples nothing else, and a prefill chunk's
 * logits are [chunk, vocab] (a 512-token chunk at a 150k vocabulary is ~300 MB, all but one row
 * unused). Walks back from `logits` through the lm_head ({@link LM_HEAD_OPS}, following the
 * non-initializer input) to the hidden state [batch, positions, hidden] that feeds it, and makes
 * every reader of that hidden state read its last position instead (a Slice on axis 1). Mutates
 * `nodes`' inputs and returns the Slice node to add, or undefined when the pattern is not there.
 * Graphs whose logits reshape takes its shape from `input_ids` would then fail to run; the
 * generated ones take it from the hidden state, Optimum's MatMul head needs no reshape.
 */
function lastPositionLogits(
  nodes: onnxProto.onnx.INodeProto[],
  initializers: ReadonlySet<string>,
): { node: onnxProto.onnx.INodeProto; constants: onnxProto.onnx.ITensorProto[] } | undefined {
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
  const int64 = (suffix: string, value: number | string): onnxProto.onnx.ITensorProto =>
    ({ name: name(suffix), dims: [1], dataType: onnx.TensorProto.DataType.INT64, int64Data: [value] });
  return {
    node: onnx.NodeProto.create({ name: name('Slice'), opType: 'Slice', input: [hidden, name('starts'), name('ends'), name('axes')], output: [last] }),
    constants: [int64('starts', -1), int64('ends', '9223372036854775807'), int64('axes', 1)],
  };
}

/**
 * The nodes that some graph output still needs. onnxruntime 1.30 runs a node whose outputs nobody
 * reads (measured: the dropped `present.*` Concats still ran, ~15 ms of a 42 ms step at batch 32,
 * past 256), so they are removed here. Names read inside subgraphs (If/Loop bodies) count as read.
 */
function withoutDeadNodes(nodes: onnxProto.onnx.INodeProto[], outputs: readonly onnxProto.onnx.IValueInfoProto[]): onnxProto.onnx.INodeProto[] {
  const subgraphInputs = (graph: onnxProto.onnx.IGraphProto | null | undefined): string[] =>
    (graph?.node ?? []).flatMap((node) => [...(node.input ?? []), ...(node.attribute ?? []).flatMap((a) => [a.g, ...(a.graphs ?? [])].flatMap(subgraphInputs))]);
  let live = nodes;
  for (;;) {
    const read = new Set(outputs.map((output) => output.name ?? ''));
    for (const node of live) {
      for (const input of node.input ?? []) read.add(input);
      for (const attribute of node.attribute ?? []) for (const name of [attribute.g, ...(attribute.graphs ?? [])].flatMap(subgraphInputs)) read.add(name);
    }
    const next = live.filter((node) => (node.output ?? []).some((output) => output !== '' && read.has(output)));
    if (next.length === live.length) return live;
    live = next;
  }
}

/** Names matching `pattern` (layer, key|value) ordered layer 0 key, layer 0 value, layer 1 key, ... */
function orderedKvNames(names: readonly string[], pattern: RegExp): string[] {
  return names
    .map((name) => ({ name, match: pattern.exec(name) }))
    .filter((entry): entry is { name: string; match: RegExpExecArray } => entry.match !== null)
    .sort((a, b) => Number(a.match[1]) * 2 + (a.match[2] === 'key' ? 0 : 1) - (Number(b.match[1]) * 2 + (b.match[2] === 'key' ? 0 : 1)))
    .map((entry) => entry.name);
}

function toFloat32(tensor: ort.Tensor): Float32Array {
  if (tensor.type === 'float32') return tensor.data as Float32Array;
  if (tensor.type === 'float16') {
    const bits = tensor.data as Uint16Array;
    const out = new Float32Array(bits.length);
    for (let i = 0; i < bits.length; i++) out[i] = halfToFloat(bits[i]!);
    return out;
  }
  throw new EngineError('internal', `Unsupported logits type ${tensor.type}.`);
}

function halfToFloat(bits: number): number {
  const sign = bits & 0x8000 ? -1 : 1;
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 0x1f) return fraction === 0 ? sign * Infinity : NaN;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}

function errorText(cause: unknown): string {
  return cause instanceof Error ? cause.message : String(cause);
}
