import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Tokenizer } from '@huggingface/tokenizers';
import onnxProto from 'onnx-proto';
import type * as ort from 'onnxruntime-node';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LlamaReference, type ReferenceKvCache } from '../src/reference/llama-reference.js';
import { ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import { RawOnnxModel } from './support/raw-greedy.js';

/** Max abs difference allowed between float32 ONNX Runtime and the float64 reference. */
const TOLERANCE = 1e-4;

let model: RawOnnxModel;
let reference: LlamaReference;
let encode: (text: string) => number[];
let vocab: number;

beforeAll(async () => {
  const dir = await ensureBuiltinModel('tiny');
  model = await RawOnnxModel.load(dir);
  reference = await LlamaReference.load(dir);
  vocab = reference.config.vocabSize;
  const tokenizer = new Tokenizer(
    JSON.parse(await readFile(join(dir, 'tokenizer.json'), 'utf8')) as object,
    JSON.parse(await readFile(join(dir, 'tokenizer_config.json'), 'utf8')) as object,
  );
  encode = (text) => tokenizer.encode(text).ids;
});
afterAll(async () => {
  await model?.release();
});

const range = (n: number, from = 0): number[] => Array.from({ length: n }, (_, i) => from + i);
const ones = (n: number): number[] => Array<number>(n).fill(1);

/** Row `[b, s, :]` of a `[batch, seq, vocab]` logits array. */
function row(data: ArrayLike<number>, seq: number, b: number, s: number): number[] {
  const start = (b * seq + s) * vocab;
  return Array.from({ length: vocab }, (_, i) => data[start + i] as number);
}

function maxAbsDiff(a: readonly number[], b: readonly number[]): number {
  expect(a).toHaveLength(b.length);
  return a.reduce((max, x, i) => Math.max(max, Math.abs(x - (b[i] as number))), 0);
}

function toReferenceCache(present: Map<string, ort.Tensor>, layers: number): ReferenceKvCache {
  const length = (present.get('0.key') as ort.Tensor).dims[2] as number;
  const widen = (name: string): Float64Array => Float64Array.from((present.get(name) as ort.Tensor).data as Float32Array);
  return {
    length,
    keys: range(layers).map((i) => widen(`${i}.key`)),
    values: range(layers).map((i) => widen(`${i}.value`)),
  };
}

const PROMPTS = [
  '<|im_start|>user\nHow does streaming work?<|im_end|>\n<|im_start|>assistant\n',
  'The weather today is grey and still.',
  'Tokyo 東京 🙂',
];

describe('the tiny ONNX graph', () => {
  it('matches the float64 reference at every position of a full forward pass', async () => {
    for (const prompt of PROMPTS) {
      const ids = encode(prompt);
      const { logits } = await model.forward([ids], [ones(ids.length)], [range(ids.length)], model.emptyCache(1));
      expect(logits.dims).toEqual([1, ids.length, vocab]);
      const expected = reference.forward({ inputIds: [ids], attentionMask: [ones(ids.length)], positionIds: [range(ids.length)] });
      for (let s = 0; s < ids.length; s++) {
        expect(maxAbsDiff(row(logits.data as Float32Array, ids.length, 0, s), row(expected.logits, ids.length, 0, s))).toBeLessThan(
          TOLERANCE,
        );
      }
    }
  });

  it('matches the reference when it prefills and then decodes with the KV cache', async () => {
    const ids = encode(PROMPTS[0] as string);
    const prefill = ids.length - 4;
    const full = reference.forward({ inputIds: [ids], attentionMask: [ones(ids.length)], positionIds: [range(ids.length)] });

    let { logits, present } = await model.forward([ids.slice(0, prefill)], [ones(prefill)], [range(prefill)], model.emptyCache(1));
    expect(
      maxAbsDiff(row(logits.data as Float32Array, prefill, 0, prefill - 1), row(full.logits, ids.length, 0, prefill - 1)),
    ).toBeLessThan(TOLERANCE);
    let refPast = reference.forward({
      inputIds: [ids.slice(0, prefill)],
      attentionMask: [ones(prefill)],
      positionIds: [range(prefill)],
    }).present;
    for (let t = prefill; t < ids.length; t++) {
      ({ logits, present } = await model.forward([[ids[t] as number]], [ones(t + 1)], [[t]], present));
      expect(present.get('0.key')?.dims).toEqual([1, 2, t + 1, 16]);
      expect(maxAbsDiff(row(logits.data as Float32Array, 1, 0, 0), row(full.logits, ids.length, 0, t))).toBeLessThan(TOLERANCE);
      // The reference fed with ONNX's own cache agrees too: present.* holds the rotated keys and the values.
      const step = reference.forward({
        inputIds: [[ids[t] as number]],
        attentionMask: [ones(t + 1)],
        positionIds: [[t]],
        past: toReferenceCache(present, 2),
      });
      expect(maxAbsDiff(row(logits.data as Float32Array, 1, 0, 0), row(step.logits, 1, 0, 0))).toBeLessThan(TOLERANCE);
      refPast = reference.forward({
        inputIds: [[ids[t] as number]],
        attentionMask: [ones(t + 1)],
        positionIds: [[t]],
        past: refPast,
      }).present;
    }
    const onnxKeys = (present.get('1.key') as ort.Tensor).data as Float32Array;
    expect(maxAbsDiff(Array.from(onnxKeys), Array.from(refPast.keys[1] as Float64Array))).toBeLessThan(TOLERANCE);
  });

  it('gives each row of a left-padded batch the logits of its unpadded single run', async () => {
    const short = encode('Good bread needs flour.');
    const long = encode('The night train left the station a few minutes after ten.');
    const width = long.length;
    const pad = width - short.length;
    const batch = await model.forward(
      [[...Array<number>(pad).fill(0), ...short], long],
      [[...Array<number>(pad).fill(0), ...ones(short.length)], ones(width)],
      [[...Array<number>(pad).fill(1), ...range(short.length)], range(width)],
      model.emptyCache(2),
    );
    const batchLogits = batch.logits.data as Float32Array;
    expect(batchLogits.every(Number.isFinite)).toBe(true); // padding rows attend to nothing: no NaN

    const single = await model.forward([short], [ones(short.length)], [range(short.length)], model.emptyCache(1));
    for (let s = 0; s < short.length; s++) {
      expect(maxAbsDiff(row(batchLogits, width, 0, pad + s), row(single.logits.data as Float32Array, short.length, 0, s))).toBeLessThan(
        TOLERANCE,
      );
    }
    const expectedLong = reference.forward({ inputIds: [long], attentionMask: [ones(width)], positionIds: [range(width)] });
    for (let s = 0; s < width; s++) {
      expect(maxAbsDiff(row(batchLogits, width, 1, s), row(expectedLong.logits, width, 0, s))).toBeLessThan(TOLERANCE);
    }

    // Two decode steps on the batched cache still match the single runs.
    let past = batch.present;
    let singlePast = single.present;
    let next = [short.at(-1) as number, long.at(-1) as number];
    for (let step = 0; step < 2; step++) {
      const mask = [[...Array<number>(pad).fill(0), ...ones(short.length + step + 1)], ones(width + step + 1)];
      const out = await model.forward([[next[0] as number], [next[1] as number]], mask, [[short.length + step], [width + step]], past);
      const alone = await model.forward([[next[0] as number]], [ones(short.length + step + 1)], [[short.length + step]], singlePast);
      expect(maxAbsDiff(row(out.logits.data as Float32Array, 1, 0, 0), row(alone.logits.data as Float32Array, 1, 0, 0))).toBeLessThan(
        TOLERANCE,
      );
      past = out.present;
      singlePast = alone.present;
      next = [7, 11];
    }
  });

  it('ignores a masked gap in the middle of a sequence', async () => {
    const ids = encode('Rain gauges, thermometers and barometers');
    const gap = 3;
    const withGap = await model.forward(
      [ids],
      [ids.map((_, i) => (i === gap ? 0 : 1))],
      [ids.map((_, i) => (i < gap ? i : Math.max(0, i - 1)))],
      model.emptyCache(1),
    );
    const without = ids.filter((_, i) => i !== gap);
    const expected = await model.forward([without], [ones(without.length)], [range(without.length)], model.emptyCache(1));
    expect(
      maxAbsDiff(
        row(withGap.logits.data as Float32Array, ids.length, 0, ids.length - 1),
        row(expected.logits.data as Float32Array, without.length, 0, without.length - 1),
      ),
    ).toBeLessThan(TOLERANCE);
    const ref = reference.forward({
      inputIds: [ids],
      attentionMask: [ids.map((_, i) => (i === gap ? 0 : 1))],
      positionIds: [ids.map((_, i) => (i < gap ? i : Math.max(0, i - 1)))],
    });
    expect(
      maxAbsDiff(row(withGap.logits.data as Float32Array, ids.length, 0, ids.length - 1), row(ref.logits, ids.length, 0, ids.length - 1)),
    ).toBeLessThan(TOLERANCE);
  });
});

describe("the plain form's attention", () => {
  it("writes each layer's scores as query · keysᵀ that only a Concat reads (no scale onnxruntime could fold into the product)", async () => {
    // A scale next to the MatMul becomes FusedMatMul's alpha, and MLAS then packs the keys instead of
    // running its one-row kernel over them in place (docs/engine.md: ~25 % of a batch-32 step at 768 slots).
    const { onnx } = onnxProto;
    const graph = onnx.ModelProto.decode(await readFile(join(await ensureBuiltinModel('tiny'), 'onnx', 'model.onnx'))).graph!;
    const producer = new Map(graph.node!.flatMap((node) => node.output!.map((name) => [name, node] as const)));
    const readers = (name: string) => graph.node!.filter((node) => node.input!.includes(name));
    const scoreProducts = graph.node!.filter((node) => {
      const keys = producer.get(node.input![1]!);
      return node.opType === 'MatMul' && keys?.opType === 'Transpose' && keys.attribute![0]!.ints!.map(Number).join() === '0,1,2,4,3';
    });
    expect(scoreProducts).toHaveLength(2 * reference.config.numLayers); // the past's and the new slots' scores
    for (const product of scoreProducts) expect(readers(product.output![0]!).map((node) => node.opType)).toEqual(['Concat']);
  });
});
