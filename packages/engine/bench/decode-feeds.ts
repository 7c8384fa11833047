/**
 * Raw onnxruntime feeds of one call of a decoder graph, for benchmarks that run a session built from
 * modified graph bytes (so not the engine's `OnnxSession`): `rows` rows of `tokens` new tokens each on
 * a past of `past` slots, every slot attended, positions after the past, every past value the same
 * small number (float32, or float16 bits with `half`).
 */
import * as ort from 'onnxruntime-node';
import type { OnnxIo } from '@sluice/model';

export function decodeFeeds(
  io: Pick<OnnxIo, 'numLayers' | 'numKvHeads' | 'headDim'>,
  { rows, past, tokens = 1, half = false }: { rows: number; past: number; tokens?: number; half?: boolean },
): Record<string, ort.Tensor> {
  const feeds: Record<string, ort.Tensor> = {
    input_ids: new ort.Tensor(
      'int64',
      BigInt64Array.from({ length: rows * tokens }, (_, i) => BigInt(5 + (i % 1000))),
      [rows, tokens],
    ),
    attention_mask: new ort.Tensor('int64', new BigInt64Array(rows * (past + tokens)).fill(1n), [rows, past + tokens]),
    position_ids: new ort.Tensor(
      'int64',
      BigInt64Array.from({ length: rows * tokens }, (_, i) => BigInt(past + (i % tokens))),
      [rows, tokens],
    ),
  };
  const dims = [rows, io.numKvHeads, past, io.headDim];
  const size = rows * io.numKvHeads * past * io.headDim;
  for (let layer = 0; layer < io.numLayers; layer++)
    for (const part of ['key', 'value'])
      feeds[`past_key_values.${layer}.${part}`] = half
        ? new ort.Tensor('float16', new Uint16Array(size).fill(0x2000), dims)
        : new ort.Tensor('float32', new Float32Array(size).fill(0.01), dims);
  return feeds;
}
