/**
 * Public types of the model package: everything about a model except running batches of it.
 * Implementations live one concept per file beside this one.
 */

/** Options of {@link Tokenizer.encode}. */
export interface EncodeOptions {
  /** Add the tokenizer's post-processor special tokens (BOS and the like). @defaultValue false */
  addSpecialTokens?: boolean;
}

/** Options of {@link Tokenizer.decode}. */
export interface DecodeOptions {
  /** Drop special tokens (`<|im_end|>`, `<|endoftext|>`, ...) from the text. @defaultValue true */
  skipSpecialTokens?: boolean;
}

/** A tokenizer loaded from `tokenizer.json` + `tokenizer_config.json`. */
export interface Tokenizer {
  readonly vocabSize: number;
  encode(text: string, options?: EncodeOptions): number[];
  decode(ids: readonly number[], options?: DecodeOptions): string;
  /** Id of a token string such as `<|im_end|>`, or undefined when the vocabulary lacks it. */
  tokenToId(token: string): number | undefined;
  /** Whether the id is a special (added, `special: true`) token. */
  isSpecial(id: number): boolean;
  /** The raw bytes the token stands for (part of a UTF-8 character, possibly): logprobs `bytes`. */
  tokenBytes?(id: number): number[];
}

/** One chat message as the OpenAI API carries it (content already flattened to text). */
export interface ChatMessage {
  role: string;
  content: string;
  name?: string;
}

/** Renders a chat with the model's Jinja `chat_template`. */
export interface ChatTemplate {
  /**
   * @param options.addGenerationPrompt End with the assistant turn's opening. @defaultValue true
   * @throws ChatTemplateError when the template rejects the conversation or fails.
   */
  render(messages: readonly ChatMessage[], options?: { addGenerationPrompt?: boolean }): string;
}

/** What the ONNX graph declares, read from the model file (not only from config.json). */
export interface OnnxIo {
  inputNames: string[];
  outputNames: string[];
  numLayers: number;
  numKvHeads: number;
  headDim: number;
  /** Element type of `past_key_values.*`. */
  kvDtype: 'float32' | 'float16';
  hasPositionIds: boolean;
  /**
   * The logits' last dimension when the graph fixes it: the ids the model can score. It may exceed
   * the tokenizer's vocabulary (models pad their embedding), never fall short of it.
   */
  vocabSize?: number;
  hasUseCacheBranch: boolean;
  hasNumLogitsToKeep: boolean;
  /** True when the graph uses com.microsoft GroupQueryAttention (cannot express gaps in the mask). */
  usesGroupQueryAttention: boolean;
  /** External-data files the weights live in, relative to the .onnx file's folder (`model.onnx_data`, ...). */
  externalDataFiles: string[];
}

/** Generation defaults from `generation_config.json` and `config.json`. */
export interface GenerationDefaults {
  eosTokenIds: number[];
  bosTokenId?: number;
  padTokenId?: number;
  /** Max prompt + completion tokens (max_position_embeddings unless overridden). */
  maxContextLength: number;
  temperature?: number;
  topP?: number;
  topK?: number;
  /** `repetition_penalty` (Qwen2.5 ships 1.05–1.1). */
  repetitionPenalty?: number;
}

/** A loaded model directory. */
export interface ModelDir {
  /** Absolute path of the directory. */
  dir: string;
  /** Model id served under `/v1/models` (the directory's base name unless overridden). */
  id: string;
  /** Parsed `config.json` (model_type, hidden_size, num_hidden_layers, ...). */
  config: Record<string, unknown>;
  generation: GenerationDefaults;
  tokenizer: Tokenizer;
  chatTemplate: ChatTemplate;
  onnxPath: string;
  /** Absolute paths of the external-data files the graph names (checked to exist); empty for a single-file model. */
  onnxDataPaths: string[];
  io: OnnxIo;
}

/** One delta out of the streaming detokenizer. */
export interface TextDelta {
  /** Text safe to emit now (never ends in a partial UTF-8 sequence or a possible stop-string prefix). */
  text: string;
  /** How many tokens produced this delta (tokens whose text was held back count where it is released). */
  tokens: number;
  /** Set when a stop string matched: the stream must end with finish reason `stop`. */
  finishReason?: 'stop';
}

/** Presets of the built-in generated model. */
export type TinyModelPreset = 'tiny' | 'bench' | 'smollm2-135m';
