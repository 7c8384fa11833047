import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { createChatTemplate, missingChatTemplate } from './chat-template.js';
import { pickNamedTemplate, specialTokenStrings, tokenizerConfigSchema } from './model-dir.js';
import { loadTokenizer } from './tokenizer.js';
import type { ChatTemplate, Tokenizer } from './types.js';

/**
 * The files that turn a request into prompt token ids, as text: what a worker publishes so that a
 * gateway can tokenize and render chat templates without the model's weights.
 */
export interface PromptFiles {
  /** `tokenizer.json`, verbatim. */
  tokenizerJson: string;
  /** `tokenizer_config.json`, verbatim (`{}` when absent). */
  tokenizerConfigJson: string;
  /** The chat template in use (`chat_template.jinja` wins over the config's), or null when there is none. */
  chatTemplate: string | null;
}

/** A model's prompt side: its tokenizer and chat template. */
export interface PromptModel {
  tokenizer: Tokenizer;
  chatTemplate: ChatTemplate;
}

/** Reads a model directory's prompt files (the same choices as `loadModelDir`). */
export async function readPromptFiles(dir: string): Promise<PromptFiles> {
  const tokenizerJson = await readFile(join(dir, 'tokenizer.json'), 'utf8');
  const tokenizerConfigJson = await readFile(join(dir, 'tokenizer_config.json'), 'utf8').catch(() => '{}');
  const jinja = await readFile(join(dir, 'chat_template.jinja'), 'utf8').catch(() => undefined);
  const config = tokenizerConfigSchema.safeParse(JSON.parse(tokenizerConfigJson));
  const fromConfig = config.success ? config.data.chat_template : undefined;
  const chatTemplate = jinja ?? (typeof fromConfig === 'string' ? fromConfig : pickNamedTemplate(fromConfig)) ?? null;
  return { tokenizerJson, tokenizerConfigJson, chatTemplate };
}

/** The JSON of the prompt files, parsed: tokenizer.json is megabytes for a large vocabulary. */
export interface ParsedPromptJson {
  tokenizer: unknown;
  tokenizerConfig: unknown;
}

/** Parses the prompt files' JSON once, for a caller that reads it too (a gateway's token-count bound). */
export function parsePromptJson(files: PromptFiles): ParsedPromptJson {
  return { tokenizer: JSON.parse(files.tokenizerJson), tokenizerConfig: JSON.parse(files.tokenizerConfigJson) };
}

/**
 * Builds the tokenizer and chat template from prompt files (e.g. read from Redis).
 * @param parsed their JSON, when the caller parsed it already
 * @throws Error when the files do not describe a tokenizer or template this library can run.
 */
export function loadPromptModel(files: PromptFiles, parsed: ParsedPromptJson = parsePromptJson(files)): PromptModel {
  const parsedConfig = tokenizerConfigSchema.safeParse(parsed.tokenizerConfig);
  const config = parsedConfig.success ? parsedConfig.data : {};
  const tokenizer = loadTokenizer(parsed.tokenizer, config);
  const chatTemplate =
    files.chatTemplate === null
      ? missingChatTemplate('this model has no chat template: use completions')
      : createChatTemplate(files.chatTemplate, specialTokenStrings(config));
  return { tokenizer, chatTemplate };
}
