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

  it('keeps external weights where they are: only the graph is re-encoded, and the session is told their folder', async () => {
    const rewritten = (await rewriteDecoderGraph(modelPath))!;
    const external = (onnx.ModelProto.decode(rewritten.bytes).graph!.initializer ?? []).filter(
      (tensor) => tensor.dataLocation === onnx.TensorProto.DataLocation.EXTERNAL,
    );
    if (!form.externalData) {
      expect(external).toEqual([]);
      expect(rewritten.externalDataFolder).toBeUndefined();
      return;
    }
    expect(external.length).toBeGreaterThan(0);
    for (const tensor of external) expect(tensor.externalData?.find((entry) => entry.key === 'location')?.value).toBe('model.onnx_data');
    expect(rewritten.externalDataFolder).toBe(dirname(modelPath));
    // The graph alone: a fraction of the weights' bytes.
    expect(rewritten.bytes.length).toBeLessThan((await stat(join(dirname(modelPath), 'model.onnx_data'))).size / 4);
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
