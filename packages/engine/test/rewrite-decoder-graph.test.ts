import { mkdtemp, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import onnxProto from 'onnx-proto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { rewriteDecoderGraph } from '../src/rewrite-decoder-graph.js';
import { MODEL_FORMS, tinyModelDir } from './support/model-forms.js';

const { onnx } = onnxProto;

describe.each(MODEL_FORMS)('the load-time rewrite of a decoder in the $label form', (form) => {
  let modelPath: string;
  let remove: () => Promise<void>;
  let scratch: string;

  beforeAll(async () => {
    const made = await tinyModelDir(form);
    remove = made.remove;
    modelPath = join(made.dir, 'onnx', 'model.onnx');
    scratch = await mkdtemp(join(tmpdir(), 'sluice-rewrite-'));
  });

  afterAll(async () => {
    await remove?.();
    if (scratch !== undefined) await rm(scratch, { recursive: true, force: true });
  });

  it('returns each layer’s new key/value slice instead of present.*, keeps no node that only fed present.*, and slices the last position before the head', async () => {
    const rewritten = await rewriteDecoderGraph(modelPath);
    expect(rewritten?.newKvNames).toHaveLength(4); // 2 layers × key, value
    const graph = onnx.ModelProto.decode(rewritten!.bytes).graph!;
    const outputs = (graph.output ?? []).map((output) => output.name);
    expect(outputs).toEqual(['logits', ...rewritten!.newKvNames]);
    const produced = new Set((graph.node ?? []).flatMap((node) => node.output ?? []));
    expect([...produced].some((name) => name.startsWith('present.'))).toBe(form.attention === 'gqa'); // GQA's own outputs stay
    if (form.attention === 'plain')
      expect(
        (graph.node ?? []).some((node) => node.opType === 'Concat' && (node.input ?? []).some((i) => i.startsWith('past_key_values.'))),
      ).toBe(false);
    expect((graph.node ?? []).some((node) => node.opType === 'Slice' && (node.name ?? '').endsWith('sluice_last_position/Slice'))).toBe(
      true,
    );
  });

  it('re-encodes the graph only: every weight is read where it lies, in model.onnx_data or in model.onnx itself, at its own bytes', async () => {
    const rewritten = (await rewriteDecoderGraph(modelPath))!;
    expect(rewritten.externalDataFolder).toBe(dirname(modelPath));
    const original = onnx.ModelProto.decode(await readFile(modelPath)).graph!;
    const tensors = new Map((onnx.ModelProto.decode(rewritten.bytes).graph!.initializer ?? []).map((tensor) => [tensor.name, tensor]));
    const dataFile = form.externalData ? 'model.onnx_data' : 'model.onnx';
    const data = await readFile(join(dirname(modelPath), dataFile));
    let moved = 0;
    for (const before of original.initializer ?? []) {
      const after = tensors.get(before.name)!;
      const entry = (key: string) => after.externalData?.find((e) => e.key === key)?.value;
      const bytes = form.externalData ? undefined : before.rawData;
      if ((bytes?.length ?? 0) < 1024 && before.dataLocation !== onnx.TensorProto.DataLocation.EXTERNAL) {
        expect(after.dataLocation ?? 0).toBe(onnx.TensorProto.DataLocation.DEFAULT); // small constants stay in the graph
        continue;
      }
      moved++;
      expect(after.dataLocation).toBe(onnx.TensorProto.DataLocation.EXTERNAL);
      expect(entry('location')).toBe(dataFile);
      // The bytes the reference names are the tensor's: for an inline model, its raw_data inside model.onnx.
      if (bytes != null) {
        const offset = Number(entry('offset'));
        expect(Number(entry('length'))).toBe(bytes.length);
        expect(Buffer.compare(data.subarray(offset, offset + bytes.length), Buffer.from(bytes))).toBe(0);
      }
    }
    expect(moved).toBeGreaterThan(0);
    // The graph alone: a fraction of the weights' bytes.
    expect(rewritten.bytes.length).toBeLessThan((await stat(join(dirname(modelPath), dataFile))).size / 4);
  });

  it('leaves a GroupQueryAttention graph with rotary inside the op to the present.* path', async () => {
    if (form.attention !== 'gqa') return;
    const model = onnx.ModelProto.decode(await readFile(modelPath));
    for (const node of model.graph?.node ?? []) {
      if (node.opType === 'GroupQueryAttention')
        node.attribute = [...(node.attribute ?? []), { name: 'do_rotary', type: onnx.AttributeProto.AttributeType.INT, i: 1 }];
    }
    const path = join(scratch, 'rotary-inside.onnx');
    await writeFile(path, onnx.ModelProto.encode(model).finish());
    expect(await rewriteDecoderGraph(path)).toBeUndefined();
  });
});
