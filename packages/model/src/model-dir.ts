import { readFile, stat } from 'node:fs/promises';
import { basename, dirname, join, resolve } from 'node:path';
import { z } from 'zod';
import { ChatTemplateError, createChatTemplate, missingChatTemplate } from './chat-template.js';
import { ModelDirError } from './model-dir-error.js';
import { readOnnxIoSync } from './onnx-io.js';
import { loadTokenizer } from './tokenizer.js';
import type { ChatTemplate, GenerationDefaults, ModelDir, Tokenizer } from './types.js';

export { ModelDirError } from './model-dir-error.js';

/** Options of {@link loadModelDir}. */
export interface LoadModelDirOptions {
  /** Model id served under `/v1/models`. @defaultValue the directory's base name */
  id?: string;
  /**
   * ONNX file to run, looked up in `onnx/` and then in the directory itself (Optimum's own exports
   * put it there), e.g. `model_fp16.onnx` or `model_quantized.onnx`. @defaultValue 'model.onnx', or
   * where there is none `decoder_model_merged.onnx`
   */
  onnxFileName?: string;
  /** Cap on prompt + completion tokens. @defaultValue config.json max_position_embeddings */
  maxContextLength?: number;
}

const positiveInt = z.int({ error: 'must be a positive integer' }).positive({ error: 'must be a positive integer' });
const tokenId = z.int({ error: 'must be a token id' }).nonnegative({ error: 'must be a token id' });
const tokenIds = z.union([tokenId, z.array(tokenId)], { error: 'must be a token id or a list of token ids' }).nullish();
/** `"<s>"`, or the `{"__type": "AddedToken", "content": "<s>", ...}` of older exports. */
const tokenString = z
  .union([z.string(), z.looseObject({ content: z.string() })], { error: 'must be a string or {content: string}' })
  .nullish();

/** config.json: only what is read here is checked; everything else passes through. */
const configSchema = z.looseObject({
  model_type: z.string({ error: 'must be a string' }).optional(),
  num_hidden_layers: positiveInt,
  num_attention_heads: positiveInt.optional(),
  num_key_value_heads: positiveInt.optional(),
  hidden_size: positiveInt.optional(),
  vocab_size: positiveInt.optional(),
  max_position_embeddings: positiveInt.optional(),
  bos_token_id: tokenId.nullish(),
  eos_token_id: tokenIds,
  pad_token_id: tokenId.nullish(),
});

/** generation_config.json (or, when absent, the same keys in config.json). */
const generationSchema = z.looseObject({
  bos_token_id: tokenId.nullish(),
  eos_token_id: tokenIds,
  pad_token_id: tokenId.nullish(),
  temperature: z.number({ error: 'must be a number ≥ 0' }).nonnegative({ error: 'must be a number ≥ 0' }).nullish(),
  top_p: z.number({ error: 'must be a number in (0, 1]' }).gt(0).lte(1, { error: 'must be a number in (0, 1]' }).nullish(),
  top_k: z.int({ error: 'must be an integer ≥ 0' }).nonnegative({ error: 'must be an integer ≥ 0' }).nullish(),
  repetition_penalty: z.number({ error: 'must be a number > 0' }).positive({ error: 'must be a number > 0' }).nullish(),
});

/** tokenizer_config.json: what the loader reads (also used by prompt-files.ts). */
export const tokenizerConfigSchema = z.looseObject({
  chat_template: z
    .union([z.string(), z.array(z.object({ name: z.string(), template: z.string() }))], {
      error: 'must be a string or a list of {name, template}',
    })
    .nullish(),
  bos_token: tokenString,
  eos_token: tokenString,
  pad_token: tokenString,
  unk_token: tokenString,
  model_max_length: z.number({ error: 'must be a number' }).nullish(),
});

/**
 * Loads a model directory in the Hugging Face / Optimum / transformers.js layout:
 *
 * - `config.json` (required): architecture; EOS/BOS/PAD ids and context length as fallbacks.
 * - `generation_config.json` (optional): EOS ids and sampling defaults; config.json otherwise.
 * - `tokenizer.json` (required) and `tokenizer_config.json` (optional): the tokenizer, the
 *   special-token strings and the chat template.
 * - `chat_template.jinja` (optional): the chat template of newer exports; wins over
 *   `tokenizer_config.json`'s `chat_template`.
 * - `onnx/model.onnx` (or `model.onnx`), with an optional `model.onnx_data` beside it.
 *
 * @throws ModelDirError naming the file and what is wrong with it.
 */
export async function loadModelDir(path: string, options: LoadModelDirOptions = {}): Promise<ModelDir> {
  const dir = resolve(path);
  const dirStat = await stat(dir).catch(() => undefined);
  if (dirStat === undefined) throw new ModelDirError(dir, 'model directory not found');
  if (!dirStat.isDirectory()) throw new ModelDirError(dir, 'not a directory');

  const config = parse('config.json', configSchema, await readJson(dir, 'config.json'));
  const generationJson = await readJson(dir, 'generation_config.json', { optional: true });
  const generation =
    generationJson === undefined
      ? parse('config.json', generationSchema, config)
      : parse('generation_config.json', generationSchema, generationJson);
  const tokenizerConfig = parse(
    'tokenizer_config.json',
    tokenizerConfigSchema,
    (await readJson(dir, 'tokenizer_config.json', { optional: true })) ?? {},
  );
  const tokenizerJson = await readJson(dir, 'tokenizer.json');
  let tokenizer: Tokenizer;
  try {
    tokenizer = loadTokenizer(tokenizerJson, tokenizerConfig);
  } catch (cause) {
    throw new ModelDirError('tokenizer.json', `cannot be loaded: ${messageOf(cause)}`, { cause });
  }

  const specialTokens = specialTokenStrings(tokenizerConfig);
  const chatTemplate = await loadChatTemplate(dir, tokenizerConfig.chat_template, specialTokens);
  const { onnxPath, onnxName } = await findOnnxFile(dir, options.onnxFileName === undefined ? DEFAULT_ONNX_FILES : [options.onnxFileName]);
  const io = readOnnxIoSync(onnxPath, onnxName);
  const onnxDataPaths: string[] = [];
  for (const location of io.externalDataFiles) {
    const path = resolve(dirname(onnxPath), location);
    if (!(await isFile(path))) {
      throw new ModelDirError(join(dirname(onnxName), location), `file not found (external data that ${onnxName} names)`);
    }
    onnxDataPaths.push(path);
  }
  if (io.numLayers !== config.num_hidden_layers) {
    throw new ModelDirError(
      onnxName,
      `graph has ${io.numLayers} layers but config.json says num_hidden_layers is ${config.num_hidden_layers} (files from different models?)`,
    );
  }

  const generationFile = generationJson === undefined ? 'config.json' : 'generation_config.json';
  const bos = generation.bos_token_id ?? config.bos_token_id;
  const padFromConfig = generation.pad_token_id ?? config.pad_token_id;
  const pad = padFromConfig ?? tokenToIdOf(tokenizer, specialTokens['pad_token']);
  checkVocabulary(
    io.vocabSize !== undefined
      ? { size: io.vocabSize, what: `the logits of ${onnxName}` }
      : config.vocab_size !== undefined
        ? { size: config.vocab_size, what: 'config.json vocab_size' }
        : undefined,
    tokenizer,
    [
      ...idList(generation.eos_token_id).map((id) => ({ file: generationFile, key: 'eos_token_id', id })),
      ...idList(config.eos_token_id).map((id) => ({ file: 'config.json', key: 'eos_token_id', id })),
      ...idList(bos).map((id) => ({ file: generation.bos_token_id != null ? generationFile : 'config.json', key: 'bos_token_id', id })),
      ...idList(padFromConfig).map((id) => ({
        file: generation.pad_token_id != null ? generationFile : 'config.json',
        key: 'pad_token_id',
        id,
      })),
    ],
  );

  const eosTokenIds = unique([
    ...idList(generation.eos_token_id),
    ...idList(config.eos_token_id),
    ...idList(tokenToIdOf(tokenizer, specialTokens['eos_token'])),
  ]);
  if (eosTokenIds.length === 0) {
    throw new ModelDirError(
      'generation_config.json',
      'no eos_token_id (nor in config.json, nor an eos_token in tokenizer_config.json): generation could never stop',
    );
  }
  const maxContextLength =
    options.maxContextLength ?? config.max_position_embeddings ?? usableModelMaxLength(tokenizerConfig.model_max_length);
  if (maxContextLength === undefined) {
    throw new ModelDirError('config.json', 'max_position_embeddings must be a positive integer (the context length)');
  }

  const defaults: GenerationDefaults = { eosTokenIds, maxContextLength };
  if (bos != null) defaults.bosTokenId = bos;
  if (pad != null) defaults.padTokenId = pad;
  if (generation.temperature != null) defaults.temperature = generation.temperature;
  if (generation.top_p != null) defaults.topP = generation.top_p;
  if (generation.top_k != null) defaults.topK = generation.top_k;
  if (generation.repetition_penalty != null) defaults.repetitionPenalty = generation.repetition_penalty;

  const modelDir: ModelDir = {
    dir,
    id: options.id ?? basename(dir),
    config,
    generation: defaults,
    tokenizer,
    chatTemplate,
    onnxPath,
    onnxDataPaths,
    io,
  };
  return modelDir;
}

/**
 * Every id the tokenizer can produce, and every id the config files name, must be one the model
 * scores. Otherwise the model loads and then every request that meets such an id fails (as the
 * client's fault, out-of-vocabulary). The logits may be larger than the tokenizer's vocabulary
 * (models pad their embedding to a round size), never smaller.
 *
 * @param vocab The model's vocabulary: the graph's logits size, else config.json vocab_size; when
 *   neither is known, configured ids are checked against the tokenizer's vocabulary.
 */
function checkVocabulary(
  vocab: { size: number; what: string } | undefined,
  tokenizer: Tokenizer,
  configured: ReadonlyArray<{ file: string; key: string; id: number }>,
): void {
  if (vocab !== undefined && tokenizer.vocabSize > vocab.size) {
    throw new ModelDirError(
      'tokenizer.json',
      `token id ${tokenizer.vocabSize - 1} is outside the model's vocabulary of ${vocab.size} ids (${vocab.what}): ` +
        'tokenizer and model from different models?',
    );
  }
  const limit = vocab ?? { size: tokenizer.vocabSize, what: 'the vocabulary of tokenizer.json' };
  for (const { file, key, id } of configured) {
    if (id >= limit.size) {
      throw new ModelDirError(file, `${key} ${id} is outside the model's vocabulary of ${limit.size} ids (${limit.what})`);
    }
  }
}

async function loadChatTemplate(
  dir: string,
  fromConfig: string | Array<{ name: string; template: string }> | null | undefined,
  specialTokens: Record<string, string>,
): Promise<ChatTemplate> {
  const jinja = await readFile(join(dir, 'chat_template.jinja'), 'utf8').catch(() => undefined);
  const [file, source] =
    jinja !== undefined
      ? ['chat_template.jinja', jinja]
      : ['tokenizer_config.json', typeof fromConfig === 'string' ? fromConfig : pickNamedTemplate(fromConfig)];
  if (source === undefined) {
    return missingChatTemplate(
      'this model has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja): use completions',
    );
  }
  let template: ChatTemplate;
  try {
    template = createChatTemplate(source, specialTokens);
  } catch (cause) {
    if (cause instanceof ChatTemplateError) throw new ModelDirError(file, cause.message, { cause });
    throw cause;
  }
  // One trial render, of the plainest conversation every chat template must accept (a template may
  // rightly refuse others: roles out of order, no system message). A template that fails here (an
  // unknown filter or method, a typo in a variable's use) would fail every chat request instead.
  try {
    template.render([{ role: 'user', content: 'Hello' }], { addGenerationPrompt: true });
  } catch (cause) {
    throw new ModelDirError(file, `the chat template cannot render a single user message: ${messageOf(cause)}`, { cause });
  }
  return template;
}

/** A list of named templates (`default`, `tool_use`, ...): the default one, else the first. */
export function pickNamedTemplate(list: Array<{ name: string; template: string }> | null | undefined): string | undefined {
  return (list ?? []).find((entry) => entry.name === 'default')?.template ?? list?.[0]?.template;
}

/**
 * The files a directory's decoder is looked for in when none is named: Optimum's single-file export,
 * then the merged decoder of transformers.js-era repos (`decoder_model_merged.onnx`, one `If` on
 * `use_cache_branch`; the engine serves its with-past branch).
 */
const DEFAULT_ONNX_FILES = ['model.onnx', 'decoder_model_merged.onnx'];

async function findOnnxFile(dir: string, fileNames: readonly string[]): Promise<{ onnxPath: string; onnxName: string }> {
  const candidates = fileNames.flatMap((fileName) => (fileName.includes('/') ? [fileName] : [`onnx/${fileName}`, fileName]));
  for (const name of candidates) {
    if (await isFile(join(dir, name))) return { onnxPath: join(dir, name), onnxName: name };
  }
  throw new ModelDirError(candidates[0]!, 'file not found');
}

/** The special-token strings a chat template reads (`bos_token`, `eos_token`, ...). */
export function specialTokenStrings(config: z.infer<typeof tokenizerConfigSchema>): Record<string, string> {
  const strings: Record<string, string> = {};
  for (const key of ['bos_token', 'eos_token', 'pad_token', 'unk_token'] as const) {
    const value = config[key];
    const content = typeof value === 'string' ? value : value?.content;
    if (content !== undefined) strings[key] = content;
  }
  return strings;
}

/** transformers writes a huge sentinel (1e30) when the length is unknown. */
function usableModelMaxLength(length: number | null | undefined): number | undefined {
  return length != null && Number.isInteger(length) && length > 0 && length <= 10_000_000 ? length : undefined;
}

function tokenToIdOf(tokenizer: Tokenizer, token: string | undefined): number | undefined {
  return token === undefined ? undefined : tokenizer.tokenToId(token);
}

function idList(ids: number | number[] | null | undefined): number[] {
  return ids == null ? [] : Array.isArray(ids) ? ids : [ids];
}

function unique(ids: number[]): number[] {
  return [...new Set(ids)];
}

async function readJson(dir: string, file: string, options: { optional?: boolean } = {}): Promise<unknown> {
  let text: string;
  try {
    text = await readFile(join(dir, file), 'utf8');
  } catch (cause) {
    const missing = (cause as NodeJS.ErrnoException).code === 'ENOENT';
    if (missing && options.optional) return undefined;
    throw new ModelDirError(file, missing ? 'file not found' : `cannot be read: ${messageOf(cause)}`, { cause });
  }
  try {
    return JSON.parse(text) as unknown;
  } catch (cause) {
    throw new ModelDirError(file, `not valid JSON: ${messageOf(cause)}`, { cause });
  }
}

function parse<T extends z.ZodType>(file: string, schema: T, value: unknown): z.infer<T> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new ModelDirError(file, 'must hold a JSON object');
  }
  const result = schema.safeParse(value);
  if (result.success) return result.data;
  const issue = result.error.issues[0]!;
  const where = issue.path.map((key, i) => (typeof key === 'number' ? `[${key}]` : i === 0 ? String(key) : `.${String(key)}`));
  throw new ModelDirError(file, `${where.join('')} ${issue.message}`);
}

async function isFile(path: string): Promise<boolean> {
  return (await stat(path).catch(() => undefined))?.isFile() ?? false;
}

function messageOf(cause: unknown): string {
  return cause instanceof Error ? cause.message : String(cause);
}
