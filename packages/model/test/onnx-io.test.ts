import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import onnxProto from 'onnx-proto';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { readOnnxIo } from '../src/onnx-io.js';
import { ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import { decoderOnnx, type DecoderOnnxOptions } from './fixtures/onnx-models.js';

// Every read the reader makes, passed through: what it reads of a file is checked, not how long it takes.
const fsReads = vi.hoisted(() => ({ bytes: 0 }));
vi.mock('node:fs', async (importOriginal) => {
  const fs = await importOriginal<typeof import('node:fs')>();
  const readSync = (...args: Parameters<typeof fs.readSync>): number => {
    const read = (fs.readSync as (...a: Parameters<typeof fs.readSync>) => number)(...args);
    fsReads.bytes += read;
    return read;
  };
  return { ...fs, default: { ...fs, readSync }, readSync };
});

const { DataType } = onnxProto.onnx.TensorProto;
const dir = mkdtempSync(join(tmpdir(), 'sluice-onnx-io-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

let counter = 0;
function writeModel(options: DecoderOnnxOptions): string {
  const path = join(dir, `model-${counter++}.onnx`);
  writeFileSync(path, decoderOnnx(options));
  return path;
}

describe('readOnnxIo', () => {
  it("reads an Optimum Llama export's inputs, outputs and KV-cache geometry", async () => {
    const io = await readOnnxIo(writeModel({ layers: 3, kvHeads: 3, headDim: 64 }));
    expect(io).toEqual({
      inputNames: [
        'input_ids',
        'attention_mask',
        'position_ids',
        ...[0, 1, 2].flatMap((i) => [`past_key_values.${i}.key`, `past_key_values.${i}.value`]),
      ],
      outputNames: ['logits', ...[0, 1, 2].flatMap((i) => [`present.${i}.key`, `present.${i}.value`])],
      numLayers: 3,
      numKvHeads: 3,
      headDim: 64,
      kvDtype: 'float32',
      hasPositionIds: true,
      hasUseCacheBranch: false,
      hasNumLogitsToKeep: false,
      usesGroupQueryAttention: false,
      externalDataFiles: [],
      vocabSize: 32,
    });
  });

  it('lists the external-data files its weights live in', async () => {
    const io = await readOnnxIo(writeModel({ externalData: 'model.onnx_data' }));
    expect(io.externalDataFiles).toEqual(['model.onnx_data']);
  });

  it('reports a float16 KV cache, use_cache_branch and num_logits_to_keep when declared', async () => {
    const io = await readOnnxIo(
      writeModel({ kvElemType: DataType.FLOAT16, useCacheBranch: true, numLogitsToKeep: true, positionIds: false }),
    );
    expect(io).toMatchObject({ kvDtype: 'float16', hasUseCacheBranch: true, hasNumLogitsToKeep: true, hasPositionIds: false });
  });

  it('detects com.microsoft GroupQueryAttention in the graph', async () => {
    expect((await readOnnxIo(writeModel({ groupQueryAttention: 'graph' }))).usesGroupQueryAttention).toBe(true);
  });

  it('detects GroupQueryAttention inside an If branch (merged decoders)', async () => {
    const io = await readOnnxIo(writeModel({ groupQueryAttention: 'if-branch', useCacheBranch: true }));
    expect(io.usesGroupQueryAttention).toBe(true);
  });

  it('leaves out weights that old exports also list as inputs', async () => {
    const io = await readOnnxIo(writeModel({ weightsAsInputs: true }));
    expect(io.inputNames).not.toContain('model.embed_tokens.weight');
  });

  it('skips large weights without reading them into memory', async () => {
    const weightBytes = 64 << 20;
    const path = writeModel({ weightBytes });
    const before = fsReads.bytes;
    const io = await readOnnxIo(path);
    expect(io.numLayers).toBe(2);
    // The graph's fields in a few chunks (2 MiB here), not the 64 MiB of weights.
    expect(fsReads.bytes - before).toBeGreaterThan(0);
    expect(fsReads.bytes - before).toBeLessThan(weightBytes / 8);
  });

  it("reads the generated tiny model's graph", async () => {
    const modelDir = await ensureBuiltinModel('tiny');
    const config = JSON.parse(readFileSync(join(modelDir, 'config.json'), 'utf8')) as Record<string, number>;
    const io = await readOnnxIo(join(modelDir, 'onnx', 'model.onnx'));
    expect(io).toMatchObject({
      numLayers: config['num_hidden_layers'],
      numKvHeads: config['num_key_value_heads'],
      headDim: config['head_dim'],
      kvDtype: 'float32',
      hasPositionIds: true,
      usesGroupQueryAttention: false,
    });
    expect(io.inputNames.slice(0, 2)).toEqual(['input_ids', 'attention_mask']);
    expect(io.outputNames[0]).toBe('logits');
  });

  it('names the file when it does not exist', async () => {
    await expect(readOnnxIo(join(dir, 'missing.onnx'))).rejects.toThrow(/missing\.onnx: file not found/);
  });

  it('names the file when it is not an ONNX model', async () => {
    const path = join(dir, 'garbage.onnx');
    writeFileSync(path, Buffer.from('{"this is": "json, not protobuf"}'));
    await expect(readOnnxIo(path)).rejects.toThrow(/garbage\.onnx: not a valid ONNX model/);
  });

  it('rejects a graph without input_ids or logits', async () => {
    await expect(readOnnxIo(writeModel({ omitInputs: ['input_ids'] }))).rejects.toThrow(/\.onnx: graph has no input_ids input/);
    await expect(readOnnxIo(writeModel({ omitOutputs: ['logits'] }))).rejects.toThrow(/\.onnx: graph has no logits output/);
  });

  it('rejects a graph without a KV cache or with a partial one', async () => {
    await expect(readOnnxIo(writeModel({ layers: 0 }))).rejects.toThrow(/no past_key_values/);
    await expect(readOnnxIo(writeModel({ omitInputs: ['past_key_values.1.value'] }))).rejects.toThrow(
      /lacks input past_key_values\.1\.value/,
    );
    await expect(readOnnxIo(writeModel({ omitOutputs: ['present.0.key'] }))).rejects.toThrow(/lacks output present\.0\.key/);
  });

  it('rejects a bfloat16 KV cache', async () => {
    await expect(readOnnxIo(writeModel({ kvElemType: DataType.BFLOAT16 }))).rejects.toThrow(/bfloat16 is not supported/);
  });
});
