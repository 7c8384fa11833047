import type { ByteLevelBpe } from './bpe-trainer.js';

/** The added special tokens, in id order (ids 0, 1, 2), as in SmolLM2's ChatML tokenizer. */
export const SPECIAL_TOKENS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'] as const;

export const SPECIAL_IDS = { endOfText: 0, imStart: 1, imEnd: 2 } as const;

/** Standard ChatML, no default system prompt. */
export const CHATML_TEMPLATE =
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}" +
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/** The JSON documents of a Hugging Face tokenizer directory. */
export interface TokenizerFiles {
  tokenizer: Record<string, unknown>;
  tokenizerConfig: Record<string, unknown>;
  specialTokensMap: Record<string, unknown>;
}

/**
 * Writes a learned byte-level BPE as `tokenizer.json` + `tokenizer_config.json` +
 * `special_tokens_map.json`, in the shape the `tokenizers` library saves (GPT-2 style: ByteLevel
 * pre-tokenizer with the GPT-2 regex, ByteLevel decoder, no normalizer, no BOS added).
 *
 * Ids: the special tokens first, then the 256 byte tokens, then the merge results.
 */
export function buildTokenizerFiles(bpe: ByteLevelBpe, modelMaxLength: number): TokenizerFiles {
  const vocab: Record<string, number> = {};
  const ordered = [...SPECIAL_TOKENS, ...bpe.tokens];
  ordered.forEach((token, id) => {
    if (Object.hasOwn(vocab, token)) throw new Error(`duplicate token ${JSON.stringify(token)}`);
    vocab[token] = id;
  });

  const addedToken = (content: string, id: number) => ({
    id,
    content,
    single_word: false,
    lstrip: false,
    rstrip: false,
    normalized: false,
    special: true,
  });
  const byteLevel = { add_prefix_space: false, trim_offsets: true, use_regex: true };

  const tokenizer = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: SPECIAL_TOKENS.map((content, id) => addedToken(content, id)),
    normalizer: null,
    pre_tokenizer: { type: 'ByteLevel', ...byteLevel },
    post_processor: { type: 'ByteLevel', ...byteLevel, trim_offsets: false },
    decoder: { type: 'ByteLevel', ...byteLevel },
    model: {
      type: 'BPE',
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: null,
      end_of_word_suffix: null,
      fuse_unk: false,
      byte_fallback: false,
      ignore_merges: false,
      vocab,
      merges: bpe.merges,
    },
  };

  const addedTokensDecoder: Record<string, unknown> = {};
  SPECIAL_TOKENS.forEach((content, id) => {
    const { id: _id, ...rest } = addedToken(content, id);
    addedTokensDecoder[String(id)] = rest;
  });
  const tokenizerConfig = {
    add_bos_token: false,
    add_eos_token: false,
    add_prefix_space: false,
    added_tokens_decoder: addedTokensDecoder,
    additional_special_tokens: ['<|im_start|>', '<|im_end|>'],
    bos_token: '<|im_start|>',
    chat_template: CHATML_TEMPLATE,
    // Keep decode(encode(text)) === text: no " ." → "." clean-up.
    clean_up_tokenization_spaces: false,
    eos_token: '<|im_end|>',
    model_max_length: modelMaxLength,
    pad_token: '<|endoftext|>',
    padding_side: 'left',
    tokenizer_class: 'GPT2Tokenizer',
    unk_token: '<|endoftext|>',
  };
  const specialTokensMap = {
    additional_special_tokens: ['<|im_start|>', '<|im_end|>'],
    bos_token: '<|im_start|>',
    eos_token: '<|im_end|>',
    pad_token: '<|endoftext|>',
    unk_token: '<|endoftext|>',
  };
  return { tokenizer, tokenizerConfig, specialTokensMap };
}
