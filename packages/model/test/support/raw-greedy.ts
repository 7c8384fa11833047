import { join } from 'node:path';
import * as ort from 'onnxruntime-node';
import { USE_CACHE_BRANCH } from '../../src/onnx-io.js';

/**
 * A deliberately plain greedy decoder over raw onnxruntime-node: prefill the (left-padded) prompts,
 * then one token per step with the KV cache fed back (present → past). Tests use it as the baseline
 * that the reference forward pass, transformers.js and the engine are compared against.
 */

export interface RawGreedyOptions {
  maxNewTokens: number;
  /** A row stops after producing this id (it is included in the output). */
  eosTokenId?: number;
  /** Id written into padded slots (their mask is 0, so its value does not matter). @defaultValue 0 */
  padTokenId?: number;
}

/** One forward step's outputs: logits of the last position of each row, and the new cache. */
interface StepResult {
  lastLogits: Float32Array[];
  present: Map<string, ort.Tensor>;
}

export class RawOnnxModel {
  private constructor(
    readonly session: ort.InferenceSession,
    readonly numLayers: number,
    readonly numKvHeads: number,
    readonly headDim: number,
  ) {}

  /** Opens `<dir>/onnx/model.onnx`; the cache layout is read from the graph's declared inputs. */
  static async load(modelDir: string, options: ort.InferenceSession.SessionOptions = {}): Promise<RawOnnxModel> {
    const session = await ort.InferenceSession.create(join(modelDir, 'onnx', 'model.onnx'), {
      intraOpNumThreads: 1,
      interOpNumThreads: 1,
      ...options,
    });
    const pastKeys = session.inputNames.filter((name) => /^past_key_values\.\d+\.key$/.test(name));
    const meta = session.inputMetadata.find((m) => m.name === 'past_key_values.0.key');
    if (meta === undefined || !meta.isTensor) throw new Error('model has no past_key_values.0.key input');
    const [, kvHeads, , headDim] = meta.shape;
    if (typeof kvHeads !== 'number' || typeof headDim !== 'number') throw new Error('KV heads and head size must be static');
    return new RawOnnxModel(session, pastKeys.length, kvHeads, headDim);
  }

  async release(): Promise<void> {
    await this.session.release();
  }

  /** An empty cache for `batch` rows. */
  emptyCache(batch: number): Map<string, ort.Tensor> {
    const cache = new Map<string, ort.Tensor>();
    for (let i = 0; i < this.numLayers; i++) {
      for (const kind of ['key', 'value']) {
        cache.set(`${i}.${kind}`, new ort.Tensor('float32', new Float32Array(0), [batch, this.numKvHeads, 0, this.headDim]));
      }
    }
    return cache;
  }

  /** One forward call; returns all logits `[batch, seq, vocab]` and the present cache. */
  async forward(
    inputIds: readonly (readonly number[])[],
    attentionMask: readonly (readonly number[])[],
    positionIds: readonly (readonly number[])[],
    past: Map<string, ort.Tensor>,
  ): Promise<{ logits: ort.Tensor; present: Map<string, ort.Tensor> }> {
    const batch = inputIds.length;
    const int64 = (rows: readonly (readonly number[])[]): ort.Tensor =>
      new ort.Tensor('int64', BigInt64Array.from(rows.flat().map((v) => BigInt(v))), [batch, rows[0]?.length ?? 0]);
    const feeds: Record<string, ort.Tensor> = {
      input_ids: int64(inputIds),
      attention_mask: int64(attentionMask),
    };
    // GroupQueryAttention with rotary inside (onnxruntime-genai's CPU exports) takes no positions.
    if (this.session.inputNames.includes('position_ids')) feeds['position_ids'] = int64(positionIds);
    // A merged decoder (Optimum's decoder_model_merged.onnx) runs its with-past branch once there is a past.
    if (this.session.inputNames.includes(USE_CACHE_BRANCH)) {
      const pastLength = (past.get('0.key') as ort.Tensor).dims[2] ?? 0;
      feeds[USE_CACHE_BRANCH] = new ort.Tensor('bool', new Uint8Array([pastLength > 0 ? 1 : 0]), [1]);
    }
    for (let i = 0; i < this.numLayers; i++) {
      feeds[`past_key_values.${i}.key`] = past.get(`${i}.key`) as ort.Tensor;
      feeds[`past_key_values.${i}.value`] = past.get(`${i}.value`) as ort.Tensor;
    }
    const out = await this.session.run(feeds);
    const present = new Map<string, ort.Tensor>();
    for (let i = 0; i < this.numLayers; i++) {
      present.set(`${i}.key`, out[`present.${i}.key`] as ort.Tensor);
      present.set(`${i}.value`, out[`present.${i}.value`] as ort.Tensor);
    }
    return { logits: out.logits as ort.Tensor, present };
  }

  private async step(
    inputIds: number[][],
    attentionMask: number[][],
    positionIds: number[][],
    past: Map<string, ort.Tensor>,
  ): Promise<StepResult> {
    const { logits, present } = await this.forward(inputIds, attentionMask, positionIds, past);
    const [batch, seq, vocab] = logits.dims as [number, number, number];
    const data = logits.data as Float32Array;
    const lastLogits = Array.from({ length: batch }, (_, b) => data.slice(((b + 1) * seq - 1) * vocab, (b + 1) * seq * vocab));
    return { lastLogits, present };
  }

  /** Greedy ids for each prompt, decoded together as one left-padded batch. */
  async greedy(prompts: readonly (readonly number[])[], options: RawGreedyOptions): Promise<number[][]> {
    const pad = options.padTokenId ?? 0;
    const width = Math.max(...prompts.map((p) => p.length));
    const mask = prompts.map((p) => [...Array<number>(width - p.length).fill(0), ...p.map(() => 1)]);
    let inputIds = prompts.map((p) => [...Array<number>(width - p.length).fill(pad), ...p]);
    let positionIds = prompts.map((p) => [...Array<number>(width - p.length).fill(0), ...p.map((_, i) => i)]);
    const nextPosition = prompts.map((p) => p.length);
    const outputs: number[][] = prompts.map(() => []);
    const done = prompts.map(() => false);
    let past = this.emptyCache(prompts.length);

    for (let step = 0; step < options.maxNewTokens && done.includes(false); step++) {
      const { lastLogits, present } = await this.step(inputIds, mask, positionIds, past);
      past = present;
      const next = lastLogits.map(argmax);
      next.forEach((id, b) => {
        if (done[b]) return;
        outputs[b]?.push(id);
        if (id === options.eosTokenId) done[b] = true;
      });
      // Finished rows keep stepping (their tokens are ignored): the batch shape stays rectangular.
      inputIds = next.map((id) => [id]);
      positionIds = nextPosition.map((p) => [p + step]);
      mask.forEach((row) => row.push(1));
    }
    return outputs;
  }
}

export function argmax(values: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < values.length; i++) if ((values[i] as number) > (values[best] as number)) best = i;
  return best;
}

/** Difference between the largest and the second-largest value. */
export function topTwoMargin(values: ArrayLike<number>): number {
  let first = -Infinity;
  let second = -Infinity;
  for (let i = 0; i < values.length; i++) {
    const v = values[i] as number;
    if (v > first) {
      second = first;
      first = v;
    } else if (v > second) {
      second = v;
    }
  }
  return first - second;
}
