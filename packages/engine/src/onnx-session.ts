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
    if (this.#pastNames.length === 0 || this.#pastNames.length !== this.#presentNames.length) {
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
   * True when the graph was rewritten to also output each layer's new key/value slice, so a decode
   * step can fetch those instead of the whole `present.*` cache ({@link runNewKv}).
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

  /** One forward pass: new tokens of every row on top of the batch's cache. */
  async run(inputs: PackedInputs, past: { data: readonly KvData[] }): Promise<ModelOutputs> {
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

/**
 * Reads the model and, where every layer's `present.{i}.key|value` is a Concat along the slot axis
 * of `past_key_values.{i}.key|value` and the step's new slice, returns the model bytes with those
 * new slices added as graph outputs (names in layer order, key then value). Otherwise (another
 * pattern, e.g. GroupQueryAttention, or weights in an external-data file, which a session created
 * from bytes could not locate) undefined: the engine then fetches `present.*` as before.
 *
 * The outputs are appended as a second serialized `graph` field holding only `output` entries:
 * protobuf merges repeated occurrences of a message field, so the original bytes are not re-encoded.
 */
async function withNewKvOutputs(modelPath: string): Promise<{ bytes: Uint8Array; newKvNames: string[] } | undefined> {
  let model: onnxProto.onnx.ModelProto;
  let bytes: Uint8Array;
  try {
    bytes = await readFile(modelPath);
    model = onnx.ModelProto.decode(bytes);
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
  const newKvNames: string[] = [];
  for (let k = 0; k < presentNames.length; k++) {
    const node = producers.get(presentNames[k]!);
    const inputs = node?.input ?? [];
    if (node?.opType !== 'Concat' || (node.domain ?? '') !== '' || inputs.length !== 2 || inputs[0] !== pastNames[k]) return undefined;
    const axis = (node.attribute ?? []).find((attribute) => attribute.name === 'axis');
    const axisValue = Number(axis?.i ?? NaN);
    if (axisValue !== 2 && axisValue !== -2) return undefined;
    const slice = inputs[1]!;
    if (slice === '' || graphNames.has(slice)) return undefined;
    newKvNames.push(slice);
  }
  const elemType = pastInfo.get(pastNames[0]!)?.type?.tensorType?.elemType ?? onnx.TensorProto.DataType.FLOAT;
  const extra = onnx.ModelProto.encode({
    graph: { output: newKvNames.map((name) => ({ name, type: { tensorType: { elemType } } })) },
  }).finish();
  const merged = new Uint8Array(bytes.length + extra.length);
  merged.set(bytes, 0);
  merged.set(extra, bytes.length);
  return { bytes: merged, newKvNames };
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
