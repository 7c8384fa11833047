/**
 * A cheap, exact lower bound on how many tokens a text encodes to: its byte length over the most
 * bytes one token can stand for. It lets the gateway refuse a prompt that cannot fit the context
 * without encoding it (a multi-megabyte prompt takes seconds of BPE on the gateway's only thread).
 *
 * The bound must never exceed the real count, so it is offered only for tokenizers where each token
 * provably covers at most `maxTokenBytes` bytes of the text: a BPE model that can spell every byte
 * (byte-level, or complete byte fallback) and never drops or fuses what it cannot spell, added tokens
 * that absorb no whitespace, and normalizers and pre-tokenizers that never delete text (Unicode
 * normalization can shrink text, so it is measured after it). Anything else gets no bound.
 */
export interface TokenCountBound {
  /** The most bytes of (normalized) text one token stands for. */
  readonly maxTokenBytes: number;
  /** At most the number of tokens `text` encodes to (special tokens and templates only add tokens). */
  atLeast(text: string): number;
}

type Json = Record<string, unknown>;

const UNICODE_FORMS = new Set(['NFC', 'NFD', 'NFKC', 'NFKD']);
/** Pre-tokenizers that split (or, Metaspace, lengthen) text but never remove any of it. */
const KEEPING_PRE_TOKENIZERS = new Set(['ByteLevel', 'Metaspace', 'Digits', 'Split', 'Punctuation', 'UnicodeScripts']);

/**
 * @param tokenizerJson `tokenizer.json`, parsed
 * @param tokenizerConfig `tokenizer_config.json`, parsed (`remove_space` and friends delete text)
 * @returns undefined when no exact bound can be given for this tokenizer
 */
export function tokenCountBound(tokenizerJson: unknown, tokenizerConfig: unknown = {}): TokenCountBound | undefined {
  if (!isObject(tokenizerJson) || !isObject(tokenizerJson['model'])) return undefined;
  const model = tokenizerJson['model'];
  const config = isObject(tokenizerConfig) ? tokenizerConfig : {};
  if (config['remove_space'] === true || config['do_lowercase_and_remove_accent'] === true) return undefined;
  if (model['type'] !== 'BPE' || !isObject(model['vocab'])) return undefined;
  // Affixes make a word's pieces differ from its characters: not worth the reasoning.
  for (const affix of ['end_of_word_suffix', 'continuing_subword_suffix', 'continuing_subword_prefix']) {
    if (model[affix] !== undefined && model[affix] !== null && model[affix] !== '') return undefined;
  }
  const vocab = model['vocab'];

  const preTokenizers = flatten(tokenizerJson['pre_tokenizer'], 'pretokenizers');
  if (preTokenizers === undefined) return undefined;
  for (const step of preTokenizers) {
    if (!KEEPING_PRE_TOKENIZERS.has(String(step['type'])) || step['behavior'] === 'Removed') return undefined;
  }
  const byteLevel = preTokenizers.some((step) => step['type'] === 'ByteLevel');
  const alphabet = byteLevelAlphabet();
  // Every byte must have a token: else the library drops (or maps to an unknown token) what it cannot spell.
  if (model['byte_fallback'] === true) {
    for (let b = 0; b < 256; b++) if (!Object.hasOwn(vocab, `<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`)) return undefined;
  } else {
    if (!byteLevel || [...alphabet].some((char) => !Object.hasOwn(vocab, char))) return undefined;
    // A merge whose result is not a token would be dropped as well.
    const merges: unknown[] = Array.isArray(model['merges']) ? model['merges'] : [];
    for (const merge of merges) {
      const pair = typeof merge === 'string' ? merge.split(' ', 2) : merge;
      if (!Array.isArray(pair) || !Object.hasOwn(vocab, pair.join(''))) return undefined;
    }
  }

  const forms = unicodeForms(tokenizerJson['normalizer']);
  if (forms === undefined) return undefined;

  let maxTokenBytes = 1;
  for (const token of Object.keys(vocab)) {
    // A byte-level token's characters each stand for one byte of the text.
    let bytes = 0;
    for (const char of token) bytes += byteLevel && alphabet.has(char) ? 1 : Buffer.byteLength(char);
    maxTokenBytes = Math.max(maxTokenBytes, bytes);
  }
  const added: unknown[] = Array.isArray(tokenizerJson['added_tokens']) ? tokenizerJson['added_tokens'] : [];
  for (const token of added) {
    if (!isObject(token) || typeof token['content'] !== 'string') return undefined;
    // lstrip / rstrip: the token swallows the whitespace next to it, however much.
    if (token['lstrip'] === true || token['rstrip'] === true) return undefined;
    maxTokenBytes = Math.max(maxTokenBytes, Buffer.byteLength(token['content']));
  }

  return {
    maxTokenBytes,
    atLeast(text) {
      let normalized = text;
      for (const form of forms) normalized = normalized.normalize(form);
      return Math.ceil(Buffer.byteLength(normalized) / maxTokenBytes);
    },
  };
}

/**
 * The Unicode normalizations to measure the text after, in order; undefined for a normalizer that may
 * delete text (Strip, Lowercase, StripAccents, BERT's, SentencePiece's charsmap, a regex Replace).
 * Prepend and a literal Replace with content at least as long only lengthen the text: measured
 * without them, the text is shorter, and the bound stays below the count.
 */
function unicodeForms(normalizer: unknown): string[] | undefined {
  const steps = flatten(normalizer, 'normalizers');
  if (steps === undefined) return undefined;
  const forms: string[] = [];
  let lengthens = false;
  for (const step of steps) {
    const type = String(step['type']);
    if (UNICODE_FORMS.has(type)) {
      forms.push(type);
    } else if (type === 'Prepend') {
      lengthens = true;
    } else if (type === 'Replace') {
      const pattern = isObject(step['pattern']) ? step['pattern']['String'] : undefined;
      const content = step['content'];
      if (typeof pattern !== 'string' || typeof content !== 'string' || Buffer.byteLength(content) < Buffer.byteLength(pattern)) {
        return undefined;
      }
      lengthens = true;
    } else {
      return undefined;
    }
  }
  // Text lengthened before or between normalizations could compose differently: keep to one kind.
  return lengthens && forms.length > 0 ? undefined : forms;
}

/** The steps of a normalizer or pre-tokenizer (a Sequence flattened); [] for none. */
function flatten(step: unknown, listKey: string): Json[] | undefined {
  if (step === null || step === undefined) return [];
  if (!isObject(step)) return undefined;
  if (step['type'] !== 'Sequence') return [step];
  const list = step[listKey];
  if (!Array.isArray(list)) return undefined;
  const out: Json[] = [];
  for (const inner of list) {
    const steps = flatten(inner, listKey);
    if (steps === undefined) return undefined;
    out.push(...steps);
  }
  return out;
}

/** GPT-2's `bytes_to_unicode` characters: the 256 a byte-level pre-tokenizer writes bytes as. */
function byteLevelAlphabet(): Set<string> {
  const printable: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) printable.push(b);
  for (let b = 0xa1; b <= 0xac; b++) printable.push(b);
  for (let b = 0xae; b <= 0xff; b++) printable.push(b);
  const chars = new Set(printable.map((b) => String.fromCodePoint(b)));
  let extra = 0;
  for (let b = 0; b < 256; b++) if (!printable.includes(b)) chars.add(String.fromCodePoint(256 + extra++));
  return chars;
}

function isObject(value: unknown): value is Json {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}
