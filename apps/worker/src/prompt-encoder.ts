import type { ChatMessage, ModelDir } from '@sluice/model';

/** Turns a job's input into prompt token ids with the model's own template and tokenizer. */
export interface PromptEncoder {
  chat(messages: readonly ChatMessage[]): number[];
  text(prompt: string): number[];
}

export function createPromptEncoder(model: Pick<ModelDir, 'tokenizer' | 'chatTemplate'>): PromptEncoder {
  return {
    // The template writes the special tokens (BOS, role markers) itself.
    chat: (messages) =>
      model.tokenizer.encode(model.chatTemplate.render(messages, { addGenerationPrompt: true }), { addSpecialTokens: false }),
    // Raw completions get the tokenizer's own special tokens, as vLLM does.
    text: (prompt) => model.tokenizer.encode(prompt, { addSpecialTokens: true }),
  };
}
