import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { loadModelDir } from '../src/model-dir.js';
import { loadPromptModel, readPromptFiles } from '../src/prompt-files.js';
import { makeModelDir, tempRoot, type FixtureModel } from './fixtures/model-dirs.js';

const { root, cleanup } = tempRoot();
afterAll(cleanup);

const messages = [
  { role: 'system', content: 'Be brief.' },
  { role: 'user', content: 'Hello there, 12 apples?' },
];

describe('prompt files (what a worker publishes for gateways)', () => {
  for (const model of ['smollm2-135m-instruct', 'qwen2.5-0.5b-instruct'] as FixtureModel[]) {
    it(`give the same prompt ids as the loaded model directory (${model})`, async () => {
      const dir = makeModelDir(root, model);
      if (model === 'qwen2.5-0.5b-instruct') writeFileSync(join(dir, 'onnx', 'model.onnx_data'), '');
      const full = await loadModelDir(dir);
      const prompt = loadPromptModel(await readPromptFiles(dir));
      const rendered = full.chatTemplate.render(messages);
      expect(prompt.chatTemplate.render(messages)).toBe(rendered);
      expect(prompt.tokenizer.encode(rendered)).toEqual(full.tokenizer.encode(rendered));
      expect(prompt.tokenizer.encode('plain text', { addSpecialTokens: true })).toEqual(
        full.tokenizer.encode('plain text', { addSpecialTokens: true }),
      );
      expect(prompt.tokenizer.vocabSize).toBe(full.tokenizer.vocabSize);
    });
  }

  it('prefer chat_template.jinja over the config, as the loader does', async () => {
    const dir = makeModelDir(root, 'smollm2-135m-instruct', 'with-jinja');
    writeFileSync(join(dir, 'chat_template.jinja'), '{% for m in messages %}[{{ m.content }}]{% endfor %}');
    const files = await readPromptFiles(dir);
    expect(files.chatTemplate).toBe('{% for m in messages %}[{{ m.content }}]{% endfor %}');
    expect(loadPromptModel(files).chatTemplate.render(messages)).toBe('[Be brief.][Hello there, 12 apples?]');
  });

  it('without a chat template, load a model whose chat rendering fails', () => {
    const prompt = loadPromptModel({
      tokenizerJson: JSON.stringify(JSON.parse('{"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}')),
      tokenizerConfigJson: '{}',
      chatTemplate: null,
    });
    expect(() => prompt.chatTemplate.render(messages)).toThrow(/no chat template/);
  });
});
