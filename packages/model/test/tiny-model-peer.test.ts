import { basename, dirname } from 'node:path';
import {
  AutoModelForCausalLM,
  AutoTokenizer,
  env,
  type PreTrainedModel,
  type PreTrainedTokenizer,
  type Tensor,
} from '@huggingface/transformers';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureBuiltinModel } from '../src/tiny-model/ensure-builtin-model.js';
import { RawOnnxModel } from './support/raw-greedy.js';

const MAX_NEW_TOKENS = 20;
const EOS = 2;

const CHATS = [
  [{ role: 'user', content: 'Hello! How are you today?' }],
  [{ role: 'user', content: 'Write a short poem about the sea.' }],
  [
    { role: 'system', content: 'You are a helpful assistant.' },
    { role: 'user', content: 'What should I cook for dinner tonight?' },
  ],
  [{ role: 'user', content: 'Explain continuous batching in one sentence.' }],
  [{ role: 'user', content: 'Translate "good morning" into French, 日本語 and Deutsch 🙂' }],
  [{ role: 'user', content: 'x' }],
];

let raw: RawOnnxModel;
let peer: PreTrainedModel;
let tokenizer: PreTrainedTokenizer;
let texts: string[];
let prompts: number[][];

beforeAll(async () => {
  const dir = await ensureBuiltinModel('tiny');
  env.allowRemoteModels = false;
  env.allowLocalModels = true;
  env.localModelPath = dirname(dir);
  tokenizer = await AutoTokenizer.from_pretrained(basename(dir));
  peer = await AutoModelForCausalLM.from_pretrained(basename(dir), { dtype: 'fp32', device: 'cpu' });
  raw = await RawOnnxModel.load(dir);
  texts = CHATS.map((chat) => tokenizer.apply_chat_template(chat, { add_generation_prompt: true, tokenize: false }));
  prompts = texts.map((text) => tokenizer.encode(text, { add_special_tokens: false }));
});
afterAll(async () => {
  await raw?.release();
  await peer?.dispose();
});

/** New tokens of each row, up to and including the first EOS. */
function newTokens(output: Tensor, promptWidth: number): number[][] {
  return (output.tolist() as bigint[][]).map((row) => {
    const tokens = row.slice(promptWidth).map(Number);
    const eos = tokens.indexOf(EOS);
    return eos === -1 ? tokens : tokens.slice(0, eos + 1);
  });
}

async function peerGreedy(batch: string[]): Promise<number[][]> {
  const inputs = tokenizer(batch, { padding: true, add_special_tokens: false });
  const output = (await peer.generate({ ...inputs, do_sample: false, max_new_tokens: MAX_NEW_TOKENS })) as Tensor;
  return newTokens(output, inputs.input_ids.dims[1] as number);
}

describe('the tiny model under transformers.js', () => {
  it('generates the same greedy tokens as a raw onnxruntime-node loop, one prompt at a time', async () => {
    for (const [i, prompt] of prompts.entries()) {
      const [expected] = await raw.greedy([prompt], { maxNewTokens: MAX_NEW_TOKENS, eosTokenId: EOS });
      expect(await peerGreedy([texts[i] as string]), `prompt ${i}`).toEqual([expected]);
    }
  });

  it('generates the same greedy tokens for a left-padded batch', async () => {
    const expected = await raw.greedy(prompts, { maxNewTokens: MAX_NEW_TOKENS, eosTokenId: EOS });
    expect(await peerGreedy(texts)).toEqual(expected);
  });

  it('gives each prompt the same greedy tokens in a batch as alone, with varied output', async () => {
    const batched = await raw.greedy(prompts, { maxNewTokens: MAX_NEW_TOKENS, eosTokenId: EOS });
    for (const [i, prompt] of prompts.entries()) {
      expect(batched[i], `prompt ${i}`).toEqual((await raw.greedy([prompt], { maxNewTokens: MAX_NEW_TOKENS, eosTokenId: EOS }))[0]);
    }
    // The batch covers both endings: a row that stops at EOS early and one that runs to the limit.
    expect(batched.some((tokens) => tokens.at(-1) === EOS && tokens.length < MAX_NEW_TOKENS)).toBe(true);
    expect(batched.some((tokens) => tokens.length === MAX_NEW_TOKENS)).toBe(true);
    // A token salad, not one token on repeat.
    const all = batched.flat();
    expect(new Set(all).size).toBeGreaterThan(all.length / 3);
  });
});
