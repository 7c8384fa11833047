import { mkdtemp, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import onnxProto from 'onnx-proto';
import * as ort from 'onnxruntime-node';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { rewriteDecoderGraph, rewrittenSessionConfig, type RewrittenGraph } from '../src/rewrite-decoder-graph.js';
import { generateTinyModel } from '@sluice/model';
import { MODEL_FORMS, tinyModelDir, usesGroupQueryAttention } from './support/model-forms.js';

const { onnx } = onnxProto;

describe.each(MODEL_FORMS)('the load-time rewrite of a decoder in the $label form', (form) => {
  let modelPath: string;
  let remove: () => Promise<void>;
  let scratch: string;
  const decomposed = form.gqaAttention === 'decomposed';
  const gqa = usesGroupQueryAttention(form.attention);
  const rewrite = (path: string) => rewriteDecoderGraph(path, { decomposeGroupQueryAttention: decomposed });

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

  it('returns each layer’s new key/value slice instead of present.*, keeps no node that only fed present.*, and reads one position a row before the head', async () => {
    const rewritten = await rewrite(modelPath);
    expect(rewritten?.newKvNames).toHaveLength(4); // 2 layers × key, value
    const graph = onnx.ModelProto.decode(rewritten!.bytes).graph!;
    const outputs = (graph.output ?? []).map((output) => output.name);
    expect(outputs).toEqual(['logits', ...rewritten!.newKvNames]);
    const produced = new Set((graph.node ?? []).flatMap((node) => node.output ?? []));
    // The GroupQueryAttention operator still writes its own present outputs; decomposed, nothing does.
    expect([...produced].some((name) => name.startsWith('present.'))).toBe(gqa && !decomposed);
    expect((graph.node ?? []).some((node) => node.opType === 'GroupQueryAttention')).toBe(gqa && !decomposed);
    // No step copies the cache: nothing concatenates the past (sdpa: its attention over present.* rewritten).
    if (!gqa)
      expect(
        (graph.node ?? []).some((node) => node.opType === 'Concat' && (node.input ?? []).some((i) => i.startsWith('past_key_values.'))),
      ).toBe(false);
    expect((graph.node ?? []).some((node) => node.opType === 'GatherND' && (node.name ?? '').includes('sluice_last_position/'))).toBe(true);
    expect(rewritten!.lastRealTokenLogits).toBe(true);
  });

  it('reads each row’s logits at its last real token: prompts right-padded in one call get, to the bit, the logits and new slices of a call of their own', async () => {
    // GroupQueryAttention takes no padding (the engine prefills its prompts one a call).
    if (gqa && !decomposed) return;
    const rewritten = (await rewrite(modelPath))!;
    const session = await rewrittenSession(rewritten);
    try {
      const { pastNames, kvHeads, headDim } = pastShape(session);
      const prompts = [[5, 6, 7], Array.from({ length: 21 }, (_, j) => 9 + j * 3), [11, 12, 13, 14, 15, 16, 17, 18, 19]];
      const call = async (rows: number[][]) => {
        const width = Math.max(...rows.map((row) => row.length));
        const padded = (fill: (row: number[], j: number) => number) =>
          rows.flatMap((row) => Array.from({ length: width }, (_, j) => fill(row, j)));
        const int64 = (values: number[]) => new ort.Tensor('int64', BigInt64Array.from(values, BigInt), [rows.length, width]);
        const out = await session.run({
          input_ids: int64(padded((row, j) => row[j] ?? 0)),
          attention_mask: int64(padded((row, j) => (j < row.length ? 1 : 0))),
          position_ids: int64(padded((_, j) => j)),
          ...Object.fromEntries(
            pastNames.map((name) => [name, new ort.Tensor('float32', new Float32Array(0), [rows.length, kvHeads, 0, headDim])]),
          ),
        });
        const logits = out['logits']!;
        expect(logits.dims).toEqual([rows.length, 1, logits.dims[2]]);
        const vocab = logits.dims[2]!;
        return rows.map((row, r) => ({
          logits: (logits.data as Float32Array).slice(r * vocab, (r + 1) * vocab),
          // The row's own slots of each new slice ([rows, kvHeads, width, headDim]).
          slices: rewritten.newKvNames.map((name) => {
            const data = out[name]!.data as Float32Array;
            return Array.from({ length: kvHeads }, (_, h) =>
              data.slice((r * kvHeads + h) * width * headDim, ((r * kvHeads + h) * width + row.length) * headDim),
            );
          }),
        }));
      };
      const together = await call(prompts);
      for (const [r, prompt] of prompts.entries()) {
        const [alone] = await call([prompt]);
        expect(together[r]!.logits, `prompt ${r}`).toEqual(alone!.logits);
        expect(together[r]!.slices, `prompt ${r}`).toEqual(alone!.slices);
      }
    } finally {
      await session.release();
    }
  });

  it('keeps external weights where they are: only the graph is re-encoded, and the session is told their folder', async () => {
    const rewritten = (await rewrite(modelPath))!;
    const external = (onnx.ModelProto.decode(rewritten.bytes).graph!.initializer ?? []).filter(
      (tensor) => tensor.dataLocation === onnx.TensorProto.DataLocation.EXTERNAL,
    );
    if (!form.externalData) {
      expect(external).toEqual([]);
      expect(rewritten.externalDataFolder).toBeUndefined();
      expect(rewrittenSessionConfig(rewritten)).toEqual({});
      return;
    }
    expect(external.length).toBeGreaterThan(0);
    for (const tensor of external) expect(tensor.externalData?.find((entry) => entry.key === 'location')?.value).toBe('model.onnx_data');
    expect(rewritten.externalDataFolder).toBe(dirname(modelPath));
    expect(rewrittenSessionConfig(rewritten)).toEqual({ model_external_initializers_file_folder_path: dirname(modelPath) });
    // The graph alone: a fraction of the weights' bytes.
    expect(rewritten.bytes.length).toBeLessThan((await stat(join(dirname(modelPath), 'model.onnx_data'))).size / 4);
  });

  it('with weightsInPlace reads no weight of an inline model but its embedding table, and its session computes the same logits to the bit', async () => {
    const inPlace = (await rewriteDecoderGraph(modelPath, { decomposeGroupQueryAttention: decomposed, weightsInPlace: true }))!;
    const initializers = onnx.ModelProto.decode(inPlace.bytes).graph!.initializer ?? [];
    const external = initializers.filter((tensor) => tensor.dataLocation === onnx.TensorProto.DataLocation.EXTERNAL);
    expect(external.length).toBeGreaterThan(0);
    const location = form.externalData ? 'model.onnx_data' : 'model.onnx';
    for (const tensor of external) expect(tensor.externalData?.find((entry) => entry.key === 'location')?.value).toBe(location);
    expect(inPlace.externalDataFolder).toBe(dirname(modelPath));
    // The embedding table (a Gather's) is the one large weight kept inside, so onnxruntime does not read it through a file mapping.
    const kept = initializers.filter((tensor) => (tensor.rawData?.length ?? 0) >= 1024);
    expect(kept.map((tensor) => tensor.name)).toEqual(form.externalData ? [] : ['model.embed_tokens.weight']);
    // The graph alone (and that table): a fraction of the weights' bytes.
    const keptBytes = kept.reduce((sum, tensor) => sum + tensor.rawData!.length, 0);
    expect(inPlace.bytes.length - keptBytes).toBeLessThan((await stat(join(dirname(modelPath), location))).size / 4);

    const copied = (await rewrite(modelPath))!;
    const [a, b] = await Promise.all([rewrittenSession(copied), rewrittenSession(inPlace)]);
    try {
      const { pastNames, kvHeads, headDim } = pastShape(a);
      const ids = [5, 6, 7, 8, 9];
      const feeds: Record<string, ort.Tensor> = {
        input_ids: new ort.Tensor('int64', BigInt64Array.from(ids.map(BigInt)), [1, ids.length]),
        attention_mask: new ort.Tensor('int64', new BigInt64Array(ids.length).fill(1n), [1, ids.length]),
      };
      if (a.inputNames.includes('position_ids'))
        feeds.position_ids = new ort.Tensor('int64', BigInt64Array.from(ids.map((_, i) => BigInt(i))), [1, ids.length]);
      for (const name of pastNames) feeds[name] = new ort.Tensor('float32', new Float32Array(0), [1, kvHeads, 0, headDim]);
      const fetches = ['logits', ...copied.newKvNames];
      const [x, y] = [await a.run(feeds, fetches), await b.run(feeds, fetches)];
      for (const name of fetches) expect([...(y[name]!.data as Float32Array)]).toEqual([...(x[name]!.data as Float32Array)]);
    } finally {
      await Promise.all([a.release(), b.release()]);
    }
  });

  it('takes the rotary out of a GroupQueryAttention that rotates inside: RotaryEmbedding nodes before it at a position_ids input, q/k/v unpacked', async () => {
    if (form.attention !== 'gqa-fused') return;
    const rewritten = (await rewrite(modelPath))!;
    const graph = onnx.ModelProto.decode(rewritten.bytes).graph!;
    expect((graph.input ?? []).map((input) => input.name)).toContain('position_ids');
    const attention = (graph.node ?? []).filter((node) => node.opType === 'GroupQueryAttention');
    expect(attention).toHaveLength(decomposed ? 0 : 2);
    for (const node of attention) {
      expect((node.attribute ?? []).map((entry) => entry.name)).not.toContain('do_rotary');
      expect(node.input).toHaveLength(7); // q, k, v, past key, past value, seqlens_k, total: no rotary tables
    }
    const count = (opType: string) => (graph.node ?? []).filter((node) => node.opType === opType).length;
    expect(count('RotaryEmbedding')).toBe(4); // q and k of each layer
    expect(count('Split')).toBeGreaterThanOrEqual(2);
  });

  it('replaces a merged decoder’s If by its with-past branch: no If and no use_cache_branch input left', async () => {
    if (form.merged !== true) return;
    const original = onnx.ModelProto.decode(await readFile(modelPath)).graph!;
    expect((original.node ?? []).map((node) => node.opType)).toEqual(['If']);
    expect((original.input ?? []).map((input) => input.name)).toContain('use_cache_branch');
    const graph = onnx.ModelProto.decode((await rewrite(modelPath))!.bytes).graph!;
    expect((graph.input ?? []).map((input) => input.name)).not.toContain('use_cache_branch');
    expect((graph.node ?? []).some((node) => node.opType === 'If')).toBe(false);
    // The decoder's own nodes now: 4 projections a layer (2 layers) and the head.
    expect((graph.node ?? []).filter((node) => node.opType === 'MatMul').length).toBeGreaterThanOrEqual(9);
  });

  it('gives the original graph’s logits, to the bit where the GroupQueryAttention operator stays, over a prefill and decode steps', async () => {
    if (form.attention === 'plain' && form.merged !== true) return;
    // Bit for bit where the same ops run in the same order; the split attention (decomposed, sdpa) sums in another.
    const exact = !decomposed && form.attention !== 'sdpa';
    await expectSameLogits(modelPath, (await rewrite(modelPath))!, exact);
  });

  it('attends to the past and the new slots separately where the export attended over present.* (no repeat_kv Expand left)', async () => {
    if (form.attention !== 'sdpa') return;
    const original = onnx.ModelProto.decode(await readFile(modelPath)).graph!;
    const all = (graph: onnxProto.onnx.IGraphProto): onnxProto.onnx.INodeProto[] =>
      (graph.node ?? []).flatMap((node) => [node, ...(node.attribute ?? []).flatMap((entry) => (entry.g == null ? [] : all(entry.g)))]);
    expect(all(original).filter((node) => node.opType === 'Expand').length).toBeGreaterThanOrEqual(4); // 2 layers × key, value (× branches)
    const graph = onnx.ModelProto.decode((await rewrite(modelPath))!.bytes).graph!;
    expect((graph.node ?? []).filter((node) => node.opType === 'Expand')).toEqual([]);
    expect((graph.node ?? []).filter((node) => (node.name ?? '').startsWith('sluice_split_attention/')).length).toBeGreaterThan(0);
  });

  it('keeps the GroupQueryAttention operator where the plain ops would compute something else (a sliding window)', async () => {
    if (form.attention !== 'gqa' || !decomposed) return;
    const model = onnx.ModelProto.decode(await readFile(modelPath));
    for (const node of model.graph?.node ?? []) {
      if (node.opType === 'GroupQueryAttention')
        node.attribute = [...(node.attribute ?? []), { name: 'local_window_size', type: onnx.AttributeProto.AttributeType.INT, i: 16 }];
    }
    const path = join(scratch, 'sliding-window.onnx');
    await writeFile(path, onnx.ModelProto.encode(model).finish());
    const rewritten = (await rewrite(path))!;
    expect(rewritten.newKvNames).toHaveLength(4);
    expect(
      (onnx.ModelProto.decode(rewritten.bytes).graph!.node ?? []).filter((node) => node.opType === 'GroupQueryAttention'),
    ).toHaveLength(2);
  });

  it('leaves a GroupQueryAttention that rotates inside to the present.* path when its rotary tables are not initializers', async () => {
    if (form.attention !== 'gqa-fused') return;
    const model = onnx.ModelProto.decode(await readFile(modelPath));
    const graph = model.graph!;
    graph.node = [
      onnx.NodeProto.create({ name: 'cos_cache/Identity', opType: 'Identity', input: ['cos_cache'], output: ['cos_cache/computed'] }),
      ...(graph.node ?? []).map((node) =>
        node.opType === 'GroupQueryAttention'
          ? { ...node, input: (node.input ?? []).map((input) => (input === 'cos_cache' ? 'cos_cache/computed' : input)) }
          : node,
      ),
    ].map((node) => onnx.NodeProto.create(node));
    const path = join(scratch, 'rotary-tables-computed.onnx');
    await writeFile(path, onnx.ModelProto.encode(model).finish());
    expect(await rewrite(path)).toBeUndefined();
  });
});

describe('the split of attention over present.* (Optimum’s exports)', () => {
  let dir: string;
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'sluice-split-attention-'));
    await generateTinyModel({ preset: 'tiny', outDir: dir, attention: 'sdpa' });
  });
  afterAll(async () => {
    if (dir !== undefined) await rm(dir, { recursive: true, force: true });
  });

  /** The tiny sdpa model with `edit` applied to its graph, written beside it. */
  async function edited(name: string, edit: (graph: onnxProto.onnx.IGraphProto) => void): Promise<string> {
    const model = onnx.ModelProto.decode(await readFile(join(dir, 'onnx', 'model.onnx')));
    edit(model.graph!);
    const path = join(dir, 'onnx', name);
    await writeFile(path, onnx.ModelProto.encode(model).finish());
    return path;
  }
  const expands = (rewritten: RewrittenGraph) =>
    (onnx.ModelProto.decode(rewritten.bytes).graph!.node ?? []).filter((node) => node.opType === 'Expand').length;

  it('takes transformers’ eager attention too: the scale as a Div after the scores’ MatMul, a Cast to float after the Softmax', async () => {
    const path = await edited('eager.onnx', (graph) => {
      const nodes = graph.node!;
      const producer = new Map(nodes.flatMap((node) => (node.output ?? []).map((output) => [output, node] as const)));
      const added: Array<[after: onnxProto.onnx.INodeProto, node: onnxProto.onnx.INodeProto]> = [];
      const dropped = new Set<onnxProto.onnx.INodeProto>();
      for (const node of nodes.filter((entry) => entry.opType === 'MatMul')) {
        const [a, b] = (node.input ?? []).map((input) => producer.get(input));
        if (a?.opType !== 'Mul' || b?.opType !== 'Mul' || producer.get(b.input![0]!)?.opType !== 'Transpose') continue;
        node.input = [a.input![0]!, b.input![0]!]; // q · kᵀ unscaled
        dropped.add(a).add(b);
        const scores = node.output![0]!;
        const divided = `${scores}/eager_div`;
        for (const reader of nodes) reader.input = (reader.input ?? []).map((input) => (input === scores ? divided : input));
        graph.initializer!.push({
          name: `${divided}/sqrt_hd`,
          dims: [],
          dataType: onnx.TensorProto.DataType.FLOAT,
          floatData: [Math.sqrt(8)],
        });
        added.push([node, { name: divided, opType: 'Div', input: [scores, `${divided}/sqrt_hd`], output: [divided] }]);
      }
      for (const softmax of nodes.filter((entry) => entry.opType === 'Softmax')) {
        const probs = softmax.output![0]!;
        const cast = `${probs}/eager_cast`;
        for (const reader of nodes) reader.input = (reader.input ?? []).map((input) => (input === probs ? cast : input));
        added.push([softmax, { name: cast, opType: 'Cast', input: [probs], output: [cast], attribute: [{ name: 'to', type: 2, i: 1 }] }]);
      }
      expect(added).toHaveLength(4);
      graph.node = nodes
        .filter((node) => !dropped.has(node))
        .flatMap((node) => [node, ...added.filter(([after]) => after === node).map(([, entry]) => entry)]);
    });
    const rewritten = (await rewriteDecoderGraph(path))!;
    expect(expands(rewritten)).toBe(0);
    await expectSameLogits(path, rewritten, false);
  });

  it('leaves a layer whose repeated keys something else also reads as exported, and splits the others', async () => {
    const path = await edited('extra-reader.onnx', (graph) => {
      const unsqueeze = graph.node!.find((node) => node.opType === 'Unsqueeze' && node.input?.[0] === 'present.0.key')!;
      graph.node!.push({ name: 'extra', opType: 'Identity', input: [unsqueeze.output![0]!], output: ['extra'] });
      graph.output!.push({ name: 'extra', type: { tensorType: { elemType: onnx.TensorProto.DataType.FLOAT } } });
    });
    const rewritten = (await rewriteDecoderGraph(path))!;
    expect(expands(rewritten)).toBe(2); // layer 0's key and value
    await expectSameLogits(path, rewritten, false);
  });
});

/**
 * One request, prefill then 39 decode steps: the original graph with present.* fed back (and
 * `use_cache_branch` where it is a merged decoder), the rewritten one with its new slices appended to
 * a cache kept here, at the same positions; logits equal to the bit (`exact`), or within 1e-4 with the
 * same greedy token.
 */
async function expectSameLogits(modelPath: string, rewritten: RewrittenGraph, exact: boolean): Promise<void> {
  const original = await ort.InferenceSession.create(modelPath, SESSION_OPTIONS);
  const candidate = await rewrittenSession(rewritten);
  try {
    const { pastNames, kvHeads, headDim } = pastShape(original);
    const int64 = (values: readonly number[]) => new ort.Tensor('int64', BigInt64Array.from(values, BigInt), [1, values.length]);
    let originalPast: Record<string, ort.Tensor> = Object.fromEntries(
      pastNames.map((name) => [name, new ort.Tensor('float32', new Float32Array(0), [1, kvHeads, 0, headDim])]),
    );
    let cache: Float32Array[] = pastNames.map(() => new Float32Array(0));
    let tokens = [5, 6, 7, 8, 9, 10, 11];
    let cached = 0;
    for (let step = 0; step < 40; step++) {
      const total = cached + tokens.length;
      const positions = { position_ids: int64(tokens.map((_, j) => cached + j)) };
      const feeds = { input_ids: int64(tokens), attention_mask: int64(Array<number>(total).fill(1)) };
      const expected = await original.run({
        ...feeds,
        ...(original.inputNames.includes('position_ids') ? positions : {}),
        // A merged decoder: its no-past branch first, then its with-past one (as Optimum and transformers.js call it).
        ...(original.inputNames.includes('use_cache_branch')
          ? { use_cache_branch: new ort.Tensor('bool', new Uint8Array([cached > 0 ? 1 : 0]), [1]) }
          : {}),
        ...originalPast,
      });
      const got = await candidate.run({
        ...feeds,
        ...positions,
        ...Object.fromEntries(pastNames.map((name, k) => [name, new ort.Tensor('float32', cache[k]!, [1, kvHeads, cached, headDim])])),
      });
      const logits = got['logits']!.data as Float32Array;
      const all = expected['logits']!.data as Float32Array;
      const want = all.subarray(all.length - logits.length);
      if (exact) expect(logits, `step ${step}`).toEqual(want);
      // The same arithmetic in another order (float32 rounding apart), the same greedy token.
      else {
        expect(Math.max(...logits.map((value, i) => Math.abs(value - want[i]!))), `step ${step}`).toBeLessThan(1e-4);
        expect(logits.indexOf(Math.max(...logits)), `step ${step}`).toBe(want.indexOf(Math.max(...want)));
      }
      originalPast = Object.fromEntries(pastNames.map((name) => [name, expected[name.replace('past_key_values.', 'present.')]!]));
      cache = cache.map((past, k) =>
        appendSlots(past, got[rewritten.newKvNames[k]!]!.data as Float32Array, kvHeads, cached, tokens.length, headDim),
      );
      cached = total;
      tokens = [logits.indexOf(Math.max(...logits))];
    }
  } finally {
    await original.release();
    await candidate.release();
  }
}

/** [kvHeads, past, headDim] and [kvHeads, added, headDim] slots → [kvHeads, past + added, headDim]. */
function appendSlots(
  past: Float32Array,
  added: Float32Array,
  kvHeads: number,
  pastLength: number,
  addedLength: number,
  headDim: number,
): Float32Array {
  const out = new Float32Array(kvHeads * (pastLength + addedLength) * headDim);
  for (let head = 0; head < kvHeads; head++) {
    out.set(past.subarray(head * pastLength * headDim, (head + 1) * pastLength * headDim), head * (pastLength + addedLength) * headDim);
    out.set(
      added.subarray(head * addedLength * headDim, (head + 1) * addedLength * headDim),
      (head * (pastLength + addedLength) + pastLength) * headDim,
    );
  }
  return out;
}

const SESSION_OPTIONS = { intraOpNumThreads: 1, logSeverityLevel: 3 as const };

/** A session of the rewritten graph, told where its external weights are. */
function rewrittenSession(rewritten: RewrittenGraph): Promise<ort.InferenceSession> {
  return ort.InferenceSession.create(rewritten.bytes, {
    ...SESSION_OPTIONS,
    extra: { session: rewrittenSessionConfig(rewritten) },
  });
}

/** The session's past_key_values inputs and their [kvHeads, headDim]. */
function pastShape(session: ort.InferenceSession): { pastNames: string[]; kvHeads: number; headDim: number } {
  const pastNames = session.inputNames.filter((name) => name.startsWith('past_key_values.'));
  const meta = session.inputMetadata.find((entry) => entry.name === pastNames[0]);
  if (meta === undefined || !meta.isTensor) throw new Error('no past_key_values input');
  const [, kvHeads, , headDim] = meta.shape as [number, number, number, number];
  return { pastNames, kvHeads, headDim };
}
