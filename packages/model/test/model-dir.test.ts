import { copyFileSync, cpSync, mkdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import onnxProto from 'onnx-proto';
import { afterAll, describe, expect, it } from 'vitest';
import { ChatTemplateError } from '../src/chat-template.js';
import { loadModelDir, ModelDirError } from '../src/model-dir.js';
import { ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import { decoderOnnx } from './fixtures/onnx-models.js';
import { makeModelDir, tempRoot } from './fixtures/model-dirs.js';
import { qwen3TokenizerDir } from './fixtures/tokenizers.js';

const { onnx } = onnxProto;

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

/** A fresh copy of the generated tiny model's directory (vocabulary 1024), changed by `edit`. */
async function tinyDir(edit: (dir: string) => void): Promise<string> {
  const dir = join(root, `tiny-${counter++}`);
  cpSync(await ensureBuiltinModel('tiny'), dir, { recursive: true });
  edit(dir);
  return dir;
}

/** Decodes the directory's onnx/model.onnx, lets `edit` change its graph inputs, and writes it back. */
function editGraphInputs(dir: string, edit: (inputs: onnxProto.onnx.IValueInfoProto[]) => void): void {
  const path = join(dir, 'onnx', 'model.onnx');
  const model = onnx.ModelProto.decode(readFileSync(path));
  edit(model.graph!.input!);
  writeFileSync(path, onnx.ModelProto.encode(model).finish());
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

  it('takes onnx/decoder_model_merged.onnx (transformers.js-era repos) where there is no model.onnx, and model.onnx before it', async () => {
    const merged = smolDir((d) => renameSync(join(d, 'onnx', 'model.onnx'), join(d, 'onnx', 'decoder_model_merged.onnx')));
    expect((await loadModelDir(merged)).onnxPath).toBe(join(merged, 'onnx', 'decoder_model_merged.onnx'));
    const both = smolDir((d) => copyFileSync(join(d, 'onnx', 'model.onnx'), join(d, 'onnx', 'decoder_model_merged.onnx')));
    expect((await loadModelDir(both)).onnxPath).toBe(join(both, 'onnx', 'model.onnx'));
  });

  it('loads a model whose logits are larger than its tokenizer (a padded vocabulary)', async () => {
    const model = await loadModelDir(smolDir());
    expect(model.io.vocabSize).toBe(49152);
    expect(model.tokenizer.vocabSize).toBeLessThan(49152);
  });

  it('loads a chat template that refuses some conversations but renders a single user message', async () => {
    const template =
      "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}" +
      '{% for message in messages %}{{ message.content }}{% endfor %}';
    const dir = await tinyDir((d) => writeFileSync(join(d, 'chat_template.jinja'), template));
    const { chatTemplate } = await loadModelDir(dir);
    expect(chatTemplate.render([{ role: 'user', content: 'Hi' }])).toBe('Hi');
    expect(() => chatTemplate.render([{ role: 'system', content: 'Be brief.' }])).toThrow(/must start with a user message/);
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

    it('when tokenizer.json comes from a model with a larger vocabulary (Qwen into the tiny model)', async () => {
      const dir = await tinyDir((d) => copyFileSync(join(qwen3TokenizerDir, 'tokenizer.json'), join(d, 'tokenizer.json')));
      expect((await loadError(dir)).message).toMatch(
        /^tokenizer\.json: token id 151\d{3} is outside the model's vocabulary of 1024 ids \(the logits of onnx\/model\.onnx\)/,
      );
    });

    it('when an added token of tokenizer.json has an id past the vocabulary', async () => {
      const dir = await tinyDir((d) =>
        editJson(d, 'tokenizer.json', (json) => {
          (json['added_tokens'] as unknown[]).push({ id: 5000, content: '<|tool|>', special: true, normalized: false });
        }),
      );
      expect((await loadError(dir)).message).toMatch(/^tokenizer\.json: token id 5000 is outside the model's vocabulary of 1024 ids/);
    });

    it('when the vocabulary of tokenizer.json is empty', async () => {
      const dir = await tinyDir((d) => editJson(d, 'tokenizer.json', (json) => ((json['model'] as Record<string, unknown>)['vocab'] = {})));
      expect((await loadError(dir)).message).toMatch(/^tokenizer\.json: cannot be loaded: model\.vocab is empty/);
    });

    it('when an EOS id of generation_config.json is past the vocabulary', async () => {
      const dir = await tinyDir((d) => editJson(d, 'generation_config.json', (json) => (json['eos_token_id'] = 999999)));
      expect((await loadError(dir)).message).toBe(
        "generation_config.json: eos_token_id 999999 is outside the model's vocabulary of 1024 ids (the logits of onnx/model.onnx)",
      );
    });

    it('when an EOS id of config.json is past the vocabulary', async () => {
      const dir = await tinyDir((d) => editJson(d, 'config.json', (json) => (json['eos_token_id'] = [2, 1024])));
      expect((await loadError(dir)).message).toMatch(/^config\.json: eos_token_id 1024 is outside the model's vocabulary of 1024 ids/);
    });

    it('when the graph has an input the engine does not feed', async () => {
      const dir = await tinyDir((d) =>
        editGraphInputs(d, (inputs) => {
          const inputIds = inputs.find((input) => input.name === 'input_ids')!;
          inputs.push({ ...inputIds, name: 'cache_position' });
        }),
      );
      expect((await loadError(dir)).message).toMatch(/^onnx\/model\.onnx: graph input cache_position is not one the engine feeds/);
    });

    it('when the graph declares input_ids as int32', async () => {
      const dir = await tinyDir((d) =>
        editGraphInputs(d, (inputs) => {
          inputs.find((input) => input.name === 'input_ids')!.type!.tensorType!.elemType = onnx.TensorProto.DataType.INT32;
        }),
      );
      expect((await loadError(dir)).message).toBe('onnx/model.onnx: graph input input_ids is int32, but the engine feeds it as int64');
    });

    it('when the graph has no attention_mask input', async () => {
      const dir = await tinyDir((d) =>
        editGraphInputs(d, (inputs) => {
          inputs.splice(
            inputs.findIndex((input) => input.name === 'attention_mask'),
            1,
          );
        }),
      );
      expect((await loadError(dir)).message).toMatch(/^onnx\/model\.onnx: graph has no attention_mask input/);
    });

    it('when the chat template fails on a single user message (an unknown filter)', async () => {
      const dir = await tinyDir((d) => writeFileSync(join(d, 'chat_template.jinja'), '{{ messages[0].content | nosuchfilter }}'));
      expect((await loadError(dir)).message).toMatch(
        /^chat_template\.jinja: the chat template cannot render a single user message: .*nosuchfilter/,
      );
    });

    it('when the chat template fails on a single user message (an unknown method)', async () => {
      const dir = await tinyDir((d) =>
        editJson(d, 'tokenizer_config.json', (json) => (json['chat_template'] = '{{ messages[0].content.nosuchmethod() }}')),
      );
      expect((await loadError(dir)).message).toMatch(/^tokenizer_config\.json: the chat template cannot render a single user message: /);
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
