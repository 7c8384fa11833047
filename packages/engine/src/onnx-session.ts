/**
 * The only file that imports onnxruntime-node: loads the model, reads what its graph declares and
 * runs one call over a left-padded batch.
 */
import * as ort from 'onnxruntime-node';
import { USE_CACHE_BRANCH } from '@sluice/model';
import { orderedKvNames, PAST_INPUT, PRESENT_OUTPUT } from './kv-names.js';
import { rewriteDecoderGraph, rewrittenSessionConfig, type RewrittenGraph } from './rewrite-decoder-graph.js';
import { EngineError } from './engine-error.js';
import type { KvData, KvShape } from './kv-batch.js';
import type { PackedInputs } from './pack-inputs.js';
import type { ExecutionProvider, GqaAttention, IntraOpSpinning } from './types.js';

export interface OnnxSessionOptions {
  modelPath: string;
  executionProvider: ExecutionProvider;
  /** 0 = onnxruntime's default. */
  intraOpThreads: number;
  /** 0 = onnxruntime's default. */
  interOpThreads: number;
  /** false: the intra-op threads block instead of spinning while they wait; 'during-run': they stop spinning when a call ends (default true). */
  intraOpSpinning?: IntraOpSpinning;
  /** Add new key/value slice outputs when the graph allows (default true; false forces the present.* path). */
  newKvOutputs?: boolean;
  /** See EngineOptions.gqaAttention (default 'decomposed'). */
  gqaAttention?: GqaAttention;
  /** See EngineOptions.weightsInPlace (default false). */
  weightsInPlace?: boolean;
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

export class OnnxSession {
  readonly io: SessionIo;
  readonly #session: ort.InferenceSession;
  readonly #pastNames: string[];
  readonly #presentNames: string[];
  /** Graph outputs holding each layer's new key/value slice (added at load), or undefined. */
  readonly #newKvNames: string[] | undefined;
  /**
   * Whether the rewritten graph runs GroupQueryAttention, which reads each row's length from the
   * mask's sum and so cannot take padded rows (false once `gqaAttention: 'decomposed'` replaced it);
   * undefined when the graph was not rewritten (the model's own graph says).
   */
  readonly groupQueryAttention: boolean | undefined;
  /** Layers whose attention over `present.*` the rewrite split (0 when none was, or the graph was not rewritten). */
  readonly splitAttentionLayers: number;
  /** Each row's logits are at its last real new token: prompts may share a call right-padded ({@link RewrittenGraph.lastRealTokenLogits}). */
  readonly lastRealTokenLogits: boolean;

  private constructor(session: ort.InferenceSession, rewritten: Omit<RewrittenGraph, 'bytes' | 'externalDataFolder'> | undefined) {
    this.#session = session;
    this.groupQueryAttention = rewritten?.groupQueryAttention;
    this.splitAttentionLayers = rewritten?.splitAttentionLayers ?? 0;
    this.lastRealTokenLogits = rewritten?.lastRealTokenLogits ?? false;
    const newKvNames = rewritten?.newKvNames;
    this.#pastNames = orderedKvNames(session.inputNames, PAST_INPUT);
    this.#presentNames = orderedKvNames(session.outputNames, PRESENT_OUTPUT);
    this.#newKvNames = newKvNames !== undefined && newKvNames.every((name) => session.outputNames.includes(name)) ? newKvNames : undefined;
    // A rewritten graph returns the new slices instead of present.* (see rewriteDecoderGraph).
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
      throw new EngineError(
        'internal',
        `past_key_values.0.key must have fixed head count and head size, got [${pastMeta.shape.join(', ')}].`,
      );
    }
    if (pastMeta.type !== 'float32' && pastMeta.type !== 'float16') {
      throw new EngineError('internal', `Unsupported KV cache type ${pastMeta.type}.`);
    }
    const vocab = logitsMeta.shape[2];
    this.io = {
      kv: { numLayers: this.#pastNames.length / 2, numKvHeads: heads, headDim, dtype: pastMeta.type },
      vocabSize: typeof vocab === 'number' ? vocab : undefined,
      hasPositionIds: session.inputNames.includes('position_ids'),
      hasUseCacheBranch: session.inputNames.includes(USE_CACHE_BRANCH),
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
    const sessionConfig: Record<string, unknown> = {};
    if (options.intraOpSpinning === false) sessionConfig.intra_op = { allow_spinning: '0' };
    if (options.intraOpSpinning === 'during-run') sessionConfig.force_spinning_stop = '1';
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
    let rewritten: RewrittenGraph | undefined;
    try {
      rewritten =
        options.newKvOutputs === false
          ? undefined
          : await rewriteDecoderGraph(options.modelPath, {
              decomposeGroupQueryAttention: options.gqaAttention === 'decomposed',
              weightsInPlace: options.weightsInPlace === true,
            });
      // A graph created from bytes finds its weights only through their folder.
      if (rewritten !== undefined) Object.assign(sessionConfig, rewrittenSessionConfig(rewritten));
      if (Object.keys(sessionConfig).length > 0) sessionOptions.extra = { session: sessionConfig };
      session =
        rewritten === undefined
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
    return new OnnxSession(session, rewritten);
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
    if (this.io.hasUseCacheBranch) feeds[USE_CACHE_BRANCH] = new ort.Tensor('bool', new Uint8Array([pastLength > 0 ? 1 : 0]), [1]);
    // An export that keeps the last `num_logits_to_keep` positions: the last one, or, where the rewrite
    // reads each row's last real token itself (after the export's slice), every new one.
    if (this.io.hasNumLogitsToKeep) {
      const keep = BigInt(this.lastRealTokenLogits ? newTokens : 1);
      feeds['num_logits_to_keep'] = new ort.Tensor('int64', new BigInt64Array([keep]), []);
    }
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
