import { AutoModelForCausalLM, env, Tensor } from '@huggingface/transformers';
import { defaultModelsRoot, ensureBuiltinModel, loadModelDir } from '@sluice/model';
import { describe, expect, it } from 'vitest';
import { createEngine } from '../src/index.js';
import { collect } from './support/collect.js';

describe('greedy decoding', () => {
  it('gives the token ids transformers.js gives on the tiny model, also when the requests share batches', async () => {
    const modelDir = await ensureBuiltinModel('tiny');
    const { tokenizer } = await loadModelDir(modelDir);
    const prompts = [
      'Once upon a time',
      'The engine batches many requests',
      'a',
      'Streaming tokens to many clients at once is the job of the gateway, and the worker decodes for all of them in steps.',
      '<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n',
    ].map((text) => tokenizer.encode(text));
    const maxTokens = 24;

    env.allowRemoteModels = false;
    env.localModelPath = `${defaultModelsRoot()}/`;
    const peer = await AutoModelForCausalLM.from_pretrained('tiny', { dtype: 'fp32', device: 'cpu' });
    const expected: number[][] = [];
    for (const ids of prompts) {
      const input = new Tensor('int64', BigInt64Array.from(ids.map(BigInt)), [1, ids.length]);
      const output = (await peer.generate({ inputs: input, max_new_tokens: maxTokens, do_sample: false })) as Tensor;
      expected.push((output.tolist() as bigint[][])[0]!.slice(ids.length).map(Number));
    }
    await peer.dispose();

    const engine = await createEngine({ modelDir, maxBatchSize: 4, maxStepTokens: 16, intraOpThreads: 1 });
    try {
      const results = await Promise.all(
        prompts.map((promptTokenIds, i) =>
          collect(engine.generate({ id: `parity-${i}`, promptTokenIds, sampling: { maxTokens, temperature: 0 } })),
        ),
      );
      expect(results.map((result) => result.tokens[0])).toEqual(expected);
    } finally {
      await engine.close();
    }
  });
});
