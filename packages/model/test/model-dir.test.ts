import { mkdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { ChatTemplateError } from '../src/chat-template.js';
import { loadModelDir, ModelDirError } from '../src/model-dir.js';
import { ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import { decoderOnnx } from './fixtures/onnx-models.js';
import { makeModelDir, tempRoot } from './fixtures/model-dirs.js';

const { root, cleanup } = tempRoot();
afterAll(cleanup);

let counter = 0;
/** A fresh copy of a SmolLM2-shaped directory, changed by `edit`. */
function smolDir(edit: (dir: string) => void = () => {}): string {
  const dir = makeModelDir(root, 'smollm2-135m-instruct', `smol-${counter++}`);
  edit(dir);
  return dir;
}

function editJson(dir: string, file: string, edit: (json: Record<string, unknown>) => void): void {
  const json = JSON.parse(readFileSync(join(dir, file), 'utf8')) as Record<string, unknown>;
  edit(json);
  writeFileSync(join(dir, file), JSON.stringify(json));
}

async function loadError(dir: string): Promise<ModelDirError> {
  const error: unknown = await loadModelDir(dir).then(
    () => undefined,
    (cause: unknown) => cause,
  );
  expect(error).toBeInstanceOf(ModelDirError);
  return error as ModelDirError;
}

describe('loadModelDir', () => {
  it('loads a SmolLM2-135M-Instruct shaped export', async () => {
    const dir = smolDir();
    const model = await loadModelDir(dir);
    expect(model.dir).toBe(dir);
    expect(model.id).toBe('smol-0');
    expect(model.config['model_type']).toBe('llama');
    expect(model.generation).toEqual({ eosTokenIds: [2], bosTokenId: 1, padTokenId: 2, maxContextLength: 8192 });
    expect(model.onnxPath).toBe(join(dir, 'onnx', 'model.onnx'));
    expect(model.onnxDataPaths).toEqual([]);
    expect(model.io).toMatchObject({ numLayers: 30, numKvHeads: 3, headDim: 64, kvDtype: 'float32' });
    expect(model.tokenizer.encode('<|im_start|>user')[0]).toBe(1);
    expect(model.chatTemplate.render([{ role: 'user', content: 'Hi' }])).toBe(
      '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' +
        '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n',
    );
  });

  it('names the external-data file the graph needs when it is missing', async () => {
    const dir = makeModelDir(root, 'qwen2.5-0.5b-instruct', 'qwen-no-data');
    await expect(loadModelDir(dir)).rejects.toThrow(
      /onnx\/model\.onnx_data: file not found \(external data that onnx\/model\.onnx names\)/,
    );
  });

  it('loads a Qwen2.5-0.5B-Instruct shaped export with the real Qwen tokenizer', async () => {
    const dir = makeModelDir(root, 'qwen2.5-0.5b-instruct');
    writeFileSync(join(dir, 'onnx', 'model.onnx_data'), '');
    const model = await loadModelDir(dir, { id: 'qwen2.5-0.5b' });
    expect(model.id).toBe('qwen2.5-0.5b');
    expect(model.generation).toEqual({
      eosTokenIds: [151645, 151643],
      bosTokenId: 151643,
      padTokenId: 151643,
      maxContextLength: 32768,
      temperature: 0.7,
      topP: 0.8,
      topK: 20,
      repetitionPenalty: 1.1,
    });
    expect(model.onnxDataPaths).toEqual([join(dir, 'onnx', 'model.onnx_data')]);
    expect(model.io).toMatchObject({ numLayers: 24, numKvHeads: 2, headDim: 64 });
    const prompt = model.chatTemplate.render([{ role: 'user', content: '你好' }]);
    expect(prompt).toBe(
      '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' +
        '<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n',
    );
    const ids = model.tokenizer.encode(prompt);
    expect(ids.filter((id) => id === 151644)).toHaveLength(3);
    expect(model.tokenizer.decode(ids, { skipSpecialTokens: false })).toBe(prompt);
  });

  it('loads the generated built-in tiny model', async () => {
    const model = await loadModelDir(await ensureBuiltinModel('tiny'));
    expect(model.id).toBe('tiny');
    expect(model.generation.eosTokenIds).toContain(model.tokenizer.tokenToId('<|im_end|>'));
    expect(model.io.numLayers).toBe(model.config['num_hidden_layers']);
    expect(model.chatTemplate.render([{ role: 'user', content: 'Hi' }])).toBe('<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n');
  });

  it('falls back to config.json when generation_config.json is missing', async () => {
    const dir = smolDir((d) => rmSync(join(d, 'generation_config.json')));
    expect((await loadModelDir(dir)).generation).toEqual({
      eosTokenIds: [2],
      bosTokenId: 1,
      padTokenId: 2,
      maxContextLength: 8192,
    });
  });

  it('merges EOS ids from generation_config.json, config.json and the tokenizer eos_token', async () => {
    const dir = smolDir((d) => {
      editJson(d, 'generation_config.json', (json) => (json['eos_token_id'] = [0]));
      editJson(d, 'config.json', (json) => (json['eos_token_id'] = null));
    });
    expect((await loadModelDir(dir)).generation.eosTokenIds).toEqual([0, 2]);
  });

  it('prefers chat_template.jinja over tokenizer_config.json', async () => {
    const dir = smolDir((d) => writeFileSync(join(d, 'chat_template.jinja'), '{{ bos_token }}{{ messages[0].content }}'));
    expect((await loadModelDir(dir)).chatTemplate.render([{ role: 'user', content: 'x' }])).toBe('<|im_start|>x');
  });

  it('picks the default template from a list of named templates', async () => {
    const dir = smolDir((d) =>
      editJson(d, 'tokenizer_config.json', (json) => {
        json['chat_template'] = [
          { name: 'tool_use', template: 'tools' },
          { name: 'default', template: 'default:{{ messages | length }}' },
        ];
      }),
    );
    expect((await loadModelDir(dir)).chatTemplate.render([{ role: 'user', content: 'x' }])).toBe('default:1');
  });

  it('loads a model without a chat template, whose render then fails clearly', async () => {
    const dir = smolDir((d) => editJson(d, 'tokenizer_config.json', (json) => delete json['chat_template']));
    const model = await loadModelDir(dir);
    expect(() => model.chatTemplate.render([{ role: 'user', content: 'x' }])).toThrow(ChatTemplateError);
    expect(() => model.chatTemplate.render([{ role: 'user', content: 'x' }])).toThrow(/no chat template/);
  });

  it('finds model.onnx at the top of the directory, and another file by name', async () => {
    const top = smolDir((d) => renameSync(join(d, 'onnx', 'model.onnx'), join(d, 'model.onnx')));
    expect((await loadModelDir(top)).onnxPath).toBe(join(top, 'model.onnx'));
    const fp16 = smolDir((d) => renameSync(join(d, 'onnx', 'model.onnx'), join(d, 'onnx', 'model_fp16.onnx')));
    expect((await loadModelDir(fp16, { onnxFileName: 'model_fp16.onnx' })).onnxPath).toBe(join(fp16, 'onnx', 'model_fp16.onnx'));
  });

  it('caps the context length when asked to', async () => {
    expect((await loadModelDir(smolDir(), { maxContextLength: 1024 })).generation.maxContextLength).toBe(1024);
  });

  describe('names the file and the problem', () => {
    it('when the directory does not exist', async () => {
      const error = await loadError(join(root, 'nope'));
      expect(error.message).toMatch(/nope: model directory not found$/);
    });

    it('when config.json is missing', async () => {
      expect((await loadError(smolDir((d) => rmSync(join(d, 'config.json'))))).message).toBe('config.json: file not found');
    });

    it('when config.json is not JSON', async () => {
      const error = await loadError(smolDir((d) => writeFileSync(join(d, 'config.json'), '{"model_type": ')));
      expect(error.file).toBe('config.json');
      expect(error.message).toMatch(/^config\.json: not valid JSON: /);
    });

    it('when num_hidden_layers is not a positive integer', async () => {
      const dir = smolDir((d) => editJson(d, 'config.json', (json) => (json['num_hidden_layers'] = 0)));
      expect((await loadError(dir)).message).toBe('config.json: num_hidden_layers must be a positive integer');
      const missing = smolDir((d) => editJson(d, 'config.json', (json) => delete json['num_hidden_layers']));
      expect((await loadError(missing)).message).toBe('config.json: num_hidden_layers must be a positive integer');
    });

    it('when an EOS id is malformed', async () => {
      const dir = smolDir((d) => editJson(d, 'generation_config.json', (json) => (json['eos_token_id'] = 'x')));
      expect((await loadError(dir)).message).toBe('generation_config.json: eos_token_id must be a token id or a list of token ids');
    });

    it('when the tokenizer cannot be loaded', async () => {
      const missing = smolDir((d) => rmSync(join(d, 'tokenizer.json')));
      expect((await loadError(missing)).message).toBe('tokenizer.json: file not found');
      const broken = smolDir((d) => writeFileSync(join(d, 'tokenizer.json'), '{"model": {"type": "Nope"}}'));
      expect((await loadError(broken)).message).toMatch(/^tokenizer\.json: cannot be loaded: /);
    });

    it('when the chat template does not parse', async () => {
      const dir = smolDir((d) => editJson(d, 'tokenizer_config.json', (json) => (json['chat_template'] = '{% for %}')));
      expect((await loadError(dir)).message).toMatch(/^tokenizer_config\.json: chat template does not parse: /);
    });

    it('when the ONNX file is missing', async () => {
      const error = await loadError(smolDir((d) => rmSync(join(d, 'onnx'), { recursive: true })));
      expect(error.message).toBe('onnx/model.onnx: file not found');
    });

    it('when the ONNX graph does not match config.json', async () => {
      const dir = smolDir((d) => writeFileSync(join(d, 'onnx', 'model.onnx'), decoderOnnx({ layers: 2 })));
      expect((await loadError(dir)).message).toMatch(
        /^onnx\/model\.onnx: graph has 2 layers but config\.json says num_hidden_layers is 30/,
      );
    });

    it('when the ONNX graph is not a decoder with a KV cache', async () => {
      const dir = smolDir((d) => {
        mkdirSync(join(d, 'onnx'), { recursive: true });
        writeFileSync(join(d, 'onnx', 'model.onnx'), decoderOnnx({ layers: 30, omitOutputs: ['logits'] }));
      });
      expect((await loadError(dir)).message).toBe('onnx/model.onnx: graph has no logits output (not a language model head?)');
    });
  });
});
