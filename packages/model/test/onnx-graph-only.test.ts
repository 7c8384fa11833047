import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import onnxProto from 'onnx-proto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { GRAPH_ONLY_MIN_BYTES, readOnnxGraphOnly } from '../src/onnx-graph-only.js';
import { exactOnnxInt64 } from '../src/onnx-proto.js';
import { ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import { generateTinyModel } from '../src/tiny-model/generate-tiny-model.js';

const { onnx } = onnxProto;

/** The tiny model's token embedding (a Gather's table, and the tied lm_head's weight). */
const EMBEDDING = 'model.embed_tokens.weight';

describe('readOnnxGraphOnly', () => {
  let inlinePath: string;
  let externalPath: string;
  let scratch: string;

  beforeAll(async () => {
    exactOnnxInt64();
    inlinePath = join(await ensureBuiltinModel('tiny'), 'onnx', 'model.onnx');
    scratch = await mkdtemp(join(tmpdir(), 'sluice-graph-only-'));
    await generateTinyModel({ preset: 'tiny', outDir: scratch, externalData: true });
    externalPath = join(scratch, 'onnx', 'model.onnx');
  });

  afterAll(async () => {
    if (scratch !== undefined) await rm(scratch, { recursive: true, force: true });
  });

  it('leaves every large weight in the file, named by its offset there, and keeps everything else as it was', async () => {
    const file = await readFile(inlinePath);
    const original = onnx.ModelProto.decode(file);
    const graphOnly = readOnnxGraphOnly(inlinePath);
    const decoded = onnx.ModelProto.decode(graphOnly);
    // The embedding table is what a Gather reads: it stays inside (a file mapping would slow every token).
    const table = original.graph!.initializer!.find((tensor) => tensor.name === EMBEDDING)!;
    expect(graphOnly.length - table.rawData!.length).toBeLessThan(file.length / 4);

    // The graph itself (nodes, inputs, outputs) and the model's header are unchanged.
    expect(decoded.graph!.node).toEqual(original.graph!.node);
    expect(decoded.graph!.input).toEqual(original.graph!.input);
    expect(decoded.graph!.output).toEqual(original.graph!.output);
    expect(decoded.opsetImport).toEqual(original.opsetImport);
    expect(decoded.irVersion).toEqual(original.irVersion);

    const initializers = decoded.graph!.initializer ?? [];
    expect(initializers.map((tensor) => tensor.name)).toEqual((original.graph!.initializer ?? []).map((tensor) => tensor.name));
    let left = 0;
    initializers.forEach((tensor, i) => {
      const before = original.graph!.initializer![i]!;
      expect(tensor.dims).toEqual(before.dims);
      expect(tensor.dataType).toBe(before.dataType);
      const raw = before.rawData!;
      if (raw.length < GRAPH_ONLY_MIN_BYTES || tensor.name === EMBEDDING) {
        expect([...tensor.rawData!]).toEqual([...raw]);
        expect(tensor.dataLocation ?? 0).toBe(onnx.TensorProto.DataLocation.DEFAULT);
        return;
      }
      left++;
      const entry = (key: string) => tensor.externalData!.find((e) => e.key === key)?.value;
      expect(tensor.dataLocation).toBe(onnx.TensorProto.DataLocation.EXTERNAL);
      expect(tensor.rawData?.length ?? 0).toBe(0);
      expect(entry('location')).toBe('model.onnx');
      const offset = Number(entry('offset'));
      expect(Number(entry('length'))).toBe(raw.length);
      expect(Buffer.compare(file.subarray(offset, offset + raw.length), Buffer.from(raw))).toBe(0);
    });
    expect(left).toBeGreaterThan(0);
  });

  it('returns a model whose weights are already in an external-data file byte for byte', async () => {
    expect(Buffer.compare(Buffer.from(readOnnxGraphOnly(externalPath)), await readFile(externalPath))).toBe(0);
  });
});
