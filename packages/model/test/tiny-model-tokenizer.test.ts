import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Tokenizer } from '@huggingface/tokenizers';
import { AutoTokenizer, env } from '@huggingface/transformers';
import { beforeAll, describe, expect, it } from 'vitest';
import { BYTE_TO_CHAR } from '../src/tiny-model/byte-level.js';
import { defaultModelsRoot, ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';

let tokenizer: Tokenizer;
let tokenizerJson: {
  model: { vocab: Record<string, number>; merges: unknown[] };
  added_tokens: Array<{ content: string; id: number; special: boolean }>;
};
let vocabSize: number;

beforeAll(async () => {
  const dir = await ensureBuiltinModel('tiny');
  tokenizerJson = JSON.parse(await readFile(join(dir, 'tokenizer.json'), 'utf8')) as typeof tokenizerJson;
  const config = JSON.parse(await readFile(join(dir, 'tokenizer_config.json'), 'utf8')) as object;
  tokenizer = new Tokenizer(tokenizerJson, config);
  vocabSize = (JSON.parse(await readFile(join(dir, 'config.json'), 'utf8')) as { vocab_size: number }).vocab_size;
});

const SAMPLES = [
  'Hello, world!',
  'The weather today: grey, then rain.\n\nTomorrow: sunny spells.',
  'Emoji 🙂🚀☕ and a family 👨‍👩‍👧 and flags 🇯🇵',
  'CJK: 東京は日本の首都です。中文也可以。한국어도.',
  'Accents: café, naïve, Straße, São Paulo, Zürich, mañana — “quotes” … ellipsis',
  'Code:\n\tif (x !== null) { return a + b; }\n  const s = `${x}`;',
  '   leading and trailing spaces   ',
  'Control \u0001 bytes \u007f and a lone surrogate-free string: \u{10FFFF}',
  'numbers 1234567890 3.14159 -42 1e-9',
];

describe('the generated tokenizer', () => {
  it('is a byte-level BPE with every byte and the ChatML special tokens', () => {
    expect(Object.keys(tokenizerJson.model.vocab)).toHaveLength(vocabSize);
    for (const char of BYTE_TO_CHAR) expect(tokenizerJson.model.vocab[char]).toBeTypeOf('number');
    expect(tokenizerJson.added_tokens.map(({ content, id, special }) => ({ content, id, special }))).toEqual([
      { content: '<|endoftext|>', id: 0, special: true },
      { content: '<|im_start|>', id: 1, special: true },
      { content: '<|im_end|>', id: 2, special: true },
    ]);
    expect(tokenizerJson.model.merges.length).toBeGreaterThan(700);
  });

  it('round-trips arbitrary Unicode text', () => {
    for (const text of SAMPLES) {
      const ids = tokenizer.encode(text).ids;
      expect(ids.every((id: number) => id >= 0 && id < vocabSize)).toBe(true);
      expect(tokenizer.decode(ids)).toBe(text);
    }
  });

  it('encodes common corpus words as single tokens', () => {
    for (const word of [' the', ' and', ' model', ' token', ' weather', ' bread', ' train', ' garden', ' request', 'The']) {
      expect(tokenizer.encode(word).ids, word).toHaveLength(1);
    }
    // A typical English sentence takes far fewer tokens than bytes.
    const sentence = 'The model reads the prompt and streams the answer to the client.';
    expect(tokenizer.encode(sentence).ids.length).toBeLessThan(sentence.length / 3);
  });

  it('encodes each special token to one id, also inside text', () => {
    expect(tokenizer.encode('<|endoftext|>').ids).toEqual([0]);
    expect(tokenizer.encode('<|im_start|>').ids).toEqual([1]);
    expect(tokenizer.encode('<|im_end|>').ids).toEqual([2]);
    const ids = tokenizer.encode('<|im_start|>user\nHi there<|im_end|>\n').ids;
    expect(ids[0]).toBe(1);
    expect(ids.filter((id: number) => id <= 2)).toEqual([1, 2]);
    expect(tokenizer.decode(ids, { skip_special_tokens: true })).toBe('user\nHi there\n');
  });

  it('loads with transformers.js AutoTokenizer and renders the ChatML template', async () => {
    env.allowRemoteModels = false;
    env.allowLocalModels = true;
    env.localModelPath = defaultModelsRoot();
    const auto = await AutoTokenizer.from_pretrained('tiny');
    for (const text of SAMPLES) {
      expect(auto.decode(auto.encode(text), { skip_special_tokens: false })).toBe(text);
      expect(auto.encode(text)).toEqual(tokenizer.encode(text).ids);
    }
    const rendered = auto.apply_chat_template(
      [
        { role: 'system', content: 'You are terse.' },
        { role: 'user', content: 'Hi!' },
      ],
      { tokenize: false, add_generation_prompt: true },
    );
    expect(rendered).toBe('<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n');
    expect(auto.eos_token_id).toBe(2);
    expect(auto.padding_side).toBe('left');
  });
});
