import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import onnxProto from 'onnx-proto';
import { exactOnnxInt64 } from '@sluice/model';

const { onnx } = onnxProto;

/**
 * A copy of the model directory `dir` whose graph takes a `num_logits_to_keep` input and keeps only
 * the last that many positions of the final hidden state before the head, as Optimum's exports of
 * recent transformers do (`hidden_states[:, -num_logits_to_keep:, :]`). The hidden state is found
 * as the generator writes it (the final norm's output, `/model/norm/Mul_*`).
 */
export async function withLogitsToKeep(dir: string): Promise<{ dir: string; remove: () => Promise<void> }> {
  exactOnnxInt64();
  const out = await mkdtemp(join(tmpdir(), 'sluice-logits-to-keep-'));
  await cp(dir, out, { recursive: true });
  const path = join(out, 'onnx', 'model.onnx');
  const model = onnx.ModelProto.decode(await readFile(path));
  const graph = model.graph!;
  const hidden = (graph.node ?? []).find((node) => (node.name ?? '').startsWith('/model/norm/Mul'))?.output?.[0];
  if (hidden === undefined) throw new Error('no final norm in the graph');
  const kept = `${hidden}/kept`;
  const int64 = (name: string, values: Array<number | string>) =>
    onnx.TensorProto.create({ name, dims: [values.length], dataType: onnx.TensorProto.DataType.INT64, int64Data: values });
  for (const node of graph.node ?? []) node.input = (node.input ?? []).map((input) => (input === hidden ? kept : input));
  // Right after the norm, so the node list stays in topological order.
  const at = (graph.node ?? []).findIndex((node) => (node.output ?? []).includes(hidden)) + 1;
  graph.node = [
    ...(graph.node ?? []).slice(0, at),
    onnx.NodeProto.create({ name: 'keep/Neg', opType: 'Neg', input: ['num_logits_to_keep'], output: ['keep/neg'] }),
    onnx.NodeProto.create({ name: 'keep/Unsqueeze', opType: 'Unsqueeze', input: ['keep/neg', 'keep/zero'], output: ['keep/starts'] }),
    onnx.NodeProto.create({ name: 'keep/Slice', opType: 'Slice', input: [hidden, 'keep/starts', 'keep/end', 'keep/one'], output: [kept] }),
    ...(graph.node ?? []).slice(at),
  ];
  graph.initializer = [
    ...(graph.initializer ?? []),
    int64('keep/zero', [0]),
    int64('keep/end', ['9223372036854775807']),
    int64('keep/one', [1]),
  ];
  graph.input = [
    ...(graph.input ?? []),
    onnx.ValueInfoProto.create({
      name: 'num_logits_to_keep',
      type: { tensorType: { elemType: onnx.TensorProto.DataType.INT64, shape: { dim: [] } } },
    }),
  ];
  await writeFile(path, onnx.ModelProto.encode(model).finish());
  return { dir: out, remove: () => rm(out, { recursive: true, force: true }) };
}
