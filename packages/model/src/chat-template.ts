import { Template } from '@huggingface/jinja';
import type { ChatMessage, ChatTemplate } from './types.js';

/**
 * A chat template failed: it does not parse, or rendering failed. When the template itself
 * rejected the conversation (`raise_exception('Conversation roles must alternate ...')`),
 * `raisedByTemplate` is true and the message is the template's own, fit to show to the client.
 */
export class ChatTemplateError extends Error {
  override readonly name = 'ChatTemplateError';

  constructor(
    message: string,
    readonly raisedByTemplate: boolean,
    options?: ErrorOptions,
  ) {
    super(message, options);
  }
}

/**
 * Compiles a Hugging Face Jinja `chat_template` with `@huggingface/jinja`.
 *
 * @param template The template source (from `tokenizer_config.json` or `chat_template.jinja`).
 * @param specialTokens Strings the template reads as variables, as `tokenizer_config.json` names
 *   them: `bos_token`, `eos_token`, `pad_token`, `unk_token`.
 * @throws ChatTemplateError when the template does not parse.
 */
export function createChatTemplate(template: string, specialTokens: Readonly<Record<string, string>> = {}): ChatTemplate {
  let compiled: Template;
  try {
    compiled = new Template(template);
  } catch (cause) {
    throw new ChatTemplateError(`chat template does not parse: ${messageOf(cause)}`, false, { cause });
  }
  // @huggingface/jinja predefines raise_exception (a plain Error) and refuses to redefine it; the
  // template's calls are pointed at our own so that its messages can be told from engine failures.
  renameIdentifier(compiled.parsed, 'raise_exception', RAISE_EXCEPTION);
  return {
    render(messages, options = {}) {
      const raise = (message: unknown): never => {
        throw new ChatTemplateError(String(message), true);
      };
      try {
        return compiled.render({
          ...specialTokens,
          messages: messages.map(toTemplateMessage),
          add_generation_prompt: options.addGenerationPrompt ?? true,
          [RAISE_EXCEPTION]: raise,
        });
      } catch (cause) {
        if (cause instanceof ChatTemplateError) throw cause;
        throw new ChatTemplateError(`chat template failed to render: ${messageOf(cause)}`, false, { cause });
      }
    },
  };
}

const RAISE_EXCEPTION = '__sluice_raise_exception';

/** Renames every Identifier node `from` in a parsed template. */
function renameIdentifier(node: unknown, from: string, to: string): void {
  if (Array.isArray(node)) {
    for (const child of node) renameIdentifier(child, from, to);
  } else if (typeof node === 'object' && node !== null) {
    const fields = node as Record<string, unknown>;
    if (fields['type'] === 'Identifier' && fields['value'] === from) fields['value'] = to;
    for (const child of Object.values(fields)) renameIdentifier(child, from, to);
  }
}

/** A template that fails at render time: for base models without a chat template. */
export function missingChatTemplate(reason: string): ChatTemplate {
  return {
    render() {
      throw new ChatTemplateError(reason, false);
    },
  };
}

/** Plain objects with only the fields that are set: templates test `message.name is defined`. */
function toTemplateMessage(message: ChatMessage): Record<string, string> {
  const out: Record<string, string> = { role: message.role, content: message.content };
  if (message.name !== undefined) out['name'] = message.name;
  return out;
}

function messageOf(cause: unknown): string {
  return cause instanceof Error ? cause.message : String(cause);
}
