import { Tokenizer as UntypedHfTokenizer } from '@huggingface/tokenizers';
import { tokenBytes } from './token-bytes.js';
import type { DecodeOptions, EncodeOptions, Tokenizer } from './types.js';

/**
 * Loads a tokenizer from the parsed contents of `tokenizer.json` and `tokenizer_config.json`
 * (the Hugging Face `tokenizers` format), on top of `@huggingface/tokenizers`.
 *
 * Decoding never applies `clean_up_tokenization_spaces`, whatever the config says: like vLLM and
 * TGI, generated text is returned as the tokens spell it (the clean-up turns `a .b` into `a.b`,
 * which mangles code, and it would make streamed text depend on tokens not generated yet).
 *
 * @throws Error when the files do not describe a tokenizer this library can run.
 */
export function loadTokenizer(tokenizerJson: unknown, tokenizerConfig: unknown): Tokenizer {
  if (!isObject(tokenizerJson)) throw new Error('tokenizer.json must hold a JSON object');
  const model = tokenizerJson['model'];
  if (!isObject(model)) throw new Error('tokenizer.json has no "model" object');
  // The library accepts an empty vocabulary and then encodes every text to no tokens at all.
  const vocab = model['vocab'];
  if ((Array.isArray(vocab) && vocab.length === 0) || (isObject(vocab) && Object.keys(vocab).length === 0)) {
    throw new Error('model.vocab is empty (every text would encode to no tokens)');
  }
  const config = isObject(tokenizerConfig) ? tokenizerConfig : {};
  const addedTokens: unknown[] = Array.isArray(tokenizerJson['added_tokens']) ? tokenizerJson['added_tokens'] : [];
  // The library reads optional sections as `null`; exports sometimes leave them out entirely.
  const json = {
    normalizer: null,
    pre_tokenizer: null,
    post_processor: null,
    decoder: null,
    ...tokenizerJson,
    added_tokens: addedTokens,
  };
  const hf = new HfTokenizer(json, { ...config, clean_up_tokenization_spaces: false });
  return new HfBackedTokenizer(hf, specialIds(hf, addedTokens, config), hasByteLevelDecoder(tokenizerJson['decoder']));
}

/** Ids that `skipSpecialTokens` drops: added tokens marked special, plus `additional_special_tokens`. */
function specialIds(hf: HfTokenizer, addedTokens: unknown[], config: Record<string, unknown>): Set<number> {
  const ids = new Set<number>();
  for (const token of addedTokens) {
    if (isObject(token) && token['special'] === true && typeof token['id'] === 'number') ids.add(token['id']);
  }
  const additional: unknown[] = Array.isArray(config['additional_special_tokens']) ? config['additional_special_tokens'] : [];
  for (const token of additional) {
    const content = isObject(token) ? token['content'] : token;
    const id = typeof content === 'string' ? hf.token_to_id(content) : undefined;
    if (id !== undefined) ids.add(id);
  }
  return ids;
}

class HfBackedTokenizer implements Tokenizer {
  readonly vocabSize: number;

  constructor(
    private readonly hf: HfTokenizer,
    private readonly specials: ReadonlySet<number>,
    private readonly byteLevel = false,
  ) {
    let maxId = -1;
    for (const id of hf.get_vocab(true).values()) if (id > maxId) maxId = id;
    this.vocabSize = maxId + 1;
  }

  encode(text: string, options: EncodeOptions = {}): number[] {
    if (text === '') return [];
    return this.hf.encode(text, { add_special_tokens: options.addSpecialTokens ?? false }).ids;
  }

  decode(ids: readonly number[], options: DecodeOptions = {}): string {
    const skipSpecial = options.skipSpecialTokens ?? true;
    // Ids the vocabulary lacks (a model's embedding is often padded past the tokenizer) decode to
    // nothing, as in the Rust `tokenizers`; the JS library would map them to a missing unk token.
    const kept = ids.filter(
      (id) => Number.isInteger(id) && this.hf.id_to_token(id) !== undefined && !(skipSpecial && this.specials.has(id)),
    );
    if (kept.length === 0) return '';
    return this.hf.decode(kept, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
  }

  tokenToId(token: string): number | undefined {
    return this.hf.token_to_id(token);
  }

  isSpecial(id: number): boolean {
    return this.specials.has(id);
  }

  tokenBytes(id: number): number[] {
    // Special tokens are text, whatever the decoder.
    const token = this.specials.has(id) ? undefined : this.hf.id_to_token(id);
    return tokenBytes(token, this.byteLevel, this.decode([id], { skipSpecialTokens: false }));
  }
}

/** A ByteLevel decoder, alone or in a Sequence. */
function hasByteLevelDecoder(decoder: unknown): boolean {
  if (!isObject(decoder)) return false;
  if (decoder['type'] === 'ByteLevel') return true;
  return decoder['type'] === 'Sequence' && Array.isArray(decoder['decoders']) && decoder['decoders'].some(hasByteLevelDecoder);
}

/**
 * The part of `@huggingface/tokenizers`' `Tokenizer` used here. The package's .d.ts files import each other
 * without file extensions, which NodeNext resolution cannot follow (skipLibCheck hides the error), so
 * TypeScript sees the class as untyped; this restates its signatures (types/core/Tokenizer.d.ts, 0.2.x).
 */
interface HfTokenizer {
  encode(text: string, options: { add_special_tokens?: boolean }): { ids: number[] };
  decode(ids: number[], options: { skip_special_tokens?: boolean; clean_up_tokenization_spaces?: boolean }): string;
  token_to_id(token: string): number | undefined;
  id_to_token(id: number): string | undefined;
  get_vocab(withAddedTokens?: boolean): Map<string, number>;
}

const HfTokenizer = UntypedHfTokenizer as new (tokenizerJson: object, tokenizerConfig: object) => HfTokenizer;

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}
