import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { ChatTemplateError, createChatTemplate } from '../src/chat-template.js';
import { sentencePieceTokenizerConfig } from './fixtures/sentencepiece-tokenizer.js';
import { qwen3TokenizerDir } from './fixtures/tokenizers.js';

const qwen3Config = JSON.parse(readFileSync(`${qwen3TokenizerDir}/tokenizer_config.json`, 'utf8')) as {
  chat_template: string;
  eos_token: string;
};

function renderError(render: () => string): ChatTemplateError {
  try {
    render();
  } catch (error) {
    expect(error).toBeInstanceOf(ChatTemplateError);
    return error as ChatTemplateError;
  }
  throw new Error('expected the template to fail');
}

describe('createChatTemplate', () => {
  describe("with Qwen3's real template", () => {
    const template = createChatTemplate(qwen3Config.chat_template, { eos_token: qwen3Config.eos_token });

    it('renders a system and a user message with the generation prompt', () => {
      expect(
        template.render([
          { role: 'system', content: 'Be brief.' },
          { role: 'user', content: 'Hi' },
        ]),
      ).toBe('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n');
    });

    it('leaves the generation prompt out when asked to', () => {
      expect(template.render([{ role: 'user', content: 'Hi' }], { addGenerationPrompt: false })).toBe('<|im_start|>user\nHi<|im_end|>\n');
    });

    it('drops the reasoning of earlier assistant turns', () => {
      const prompt = template.render([
        { role: 'user', content: 'What is 2+2?' },
        { role: 'assistant', content: '<think>\nadd them\n</think>\n\n4' },
        { role: 'user', content: 'And 3+3?' },
      ]);
      expect(prompt).toBe(
        '<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n' +
          '<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n',
      );
    });
  });

  it('passes bos_token and eos_token to the template', () => {
    const template = createChatTemplate(sentencePieceTokenizerConfig.chat_template, { bos_token: '<s>', eos_token: '</s>' });
    expect(
      template.render([
        { role: 'user', content: 'Hi' },
        { role: 'assistant', content: 'Hello' },
        { role: 'user', content: 'Bye' },
      ]),
    ).toBe('<s>[INST] Hi [/INST]Hello</s>[INST] Bye [/INST]');
  });

  it("reports the template's own raise_exception message", () => {
    const template = createChatTemplate(sentencePieceTokenizerConfig.chat_template, { bos_token: '<s>', eos_token: '</s>' });
    const error = renderError(() => template.render([{ role: 'assistant', content: 'first' }]));
    expect(error.message).toBe('Conversation roles must alternate user/assistant/user/assistant/...');
    expect(error.raisedByTemplate).toBe(true);
  });

  it('gives a message name only when it is set', () => {
    const template = createChatTemplate('{% for m in messages %}{{ m.name if m.name is defined else "-" }};{% endfor %}');
    expect(
      template.render([
        { role: 'user', content: 'a', name: 'alice' },
        { role: 'user', content: 'b' },
      ]),
    ).toBe('alice;-;');
  });

  it('fails clearly on a template that does not parse', () => {
    expect(() => createChatTemplate('{% if messages %}unclosed')).toThrow(/^chat template does not parse: /);
  });

  it('fails clearly when rendering fails inside the engine', () => {
    const template = createChatTemplate('{{ messages[0].content | no_such_filter }}');
    const error = renderError(() => template.render([{ role: 'user', content: 'x' }]));
    expect(error.message).toMatch(/^chat template failed to render: /);
    expect(error.raisedByTemplate).toBe(false);
  });
});
