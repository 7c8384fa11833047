import { describe, expect, it } from 'vitest';
import type { ResolvedSampling } from '../src/resolve-request.js';
import { SeededRandom } from '../src/seeded-random.js';
import { TokenSampler, argmax, logSumExp, topIndices } from '../src/token-sampler.js';

const defaults: ResolvedSampling = {
  maxTokens: 16,
  temperature: 1,
  topP: 1,
  topK: 0,
  minP: 0,
  presencePenalty: 0,
  frequencyPenalty: 0,
  repetitionPenalty: 1,
  seed: 1,
  logprobs: false,
  topLogprobs: 0,
  stop: [],
  stopTokenIds: [],
  ignoreEos: false,
  logitBias: [],
  n: 1,
};

function sampler(params: Partial<ResolvedSampling>, prompt: number[] = [], seed = 7): TokenSampler {
  return new TokenSampler({ ...defaults, ...params }, new Set(prompt), new SeededRandom(seed));
}

function histogram(logits: number[], params: Partial<ResolvedSampling>, draws: number): number[] {
  const counts = new Array<number>(logits.length).fill(0);
  const s = sampler(params);
  const row = Float32Array.from(logits);
  for (let i = 0; i < draws; i++) {
    counts[s.sample(row, 0, row.length).tokenId]! += 1;
  }
  return counts;
}

describe('SeededRandom', () => {
  it('gives the same numbers for the same seed and different ones for another seed or stream', () => {
    const draw = (seed: number, stream = 0) => {
      const random = new SeededRandom(seed, stream);
      return Array.from({ length: 5 }, () => random.next());
    };
    expect(draw(42)).toEqual(draw(42));
    expect(draw(42)).not.toEqual(draw(43));
    expect(draw(42, 0)).not.toEqual(draw(42, 1));
    expect(draw(2 ** 40)).not.toEqual(draw(0));
  });

  it('draws uniformly in [0, 1)', () => {
    const random = new SeededRandom(3);
    const values = Array.from({ length: 20_000 }, () => random.next());
    expect(Math.min(...values)).toBeGreaterThanOrEqual(0);
    expect(Math.max(...values)).toBeLessThan(1);
    expect(values.reduce((sum, value) => sum + value, 0) / values.length).toBeCloseTo(0.5, 1);
  });
});

describe('TokenSampler', () => {
  it('picks the argmax when greedy, the lowest id on ties', () => {
    const s = sampler({ temperature: 0 });
    expect(s.sample(Float32Array.from([1, 5, 5, 2]), 0, 4).tokenId).toBe(1);
  });

  it('reads its own row out of a batch of logits', () => {
    const logits = Float32Array.from([9, 0, 0, 0, 0, 9, 0]);
    expect(sampler({ temperature: 0 }).sample(logits, 3, 3).tokenId).toBe(2);
  });

  it('draws in proportion to softmax(logits / temperature)', () => {
    const logits = [Math.log(1), Math.log(2), Math.log(7)];
    const counts = histogram(logits, {}, 20_000);
    expect(counts[0]! / 20_000).toBeCloseTo(0.1, 1);
    expect(counts[1]! / 20_000).toBeCloseTo(0.2, 1);
    expect(counts[2]! / 20_000).toBeCloseTo(0.7, 1);
    const sharp = histogram(logits, { temperature: 0.25 }, 5_000);
    expect(sharp[2]! / 5_000).toBeGreaterThan(0.95);
  });

  it('keeps only the k most likely tokens with top_k', () => {
    const counts = histogram([3, 2, 1, 0, 2.5], { topK: 2 }, 3_000);
    expect(counts[1]! + counts[2]! + counts[3]!).toBe(0);
    expect(counts[0]! > 0 && counts[4]! > 0).toBe(true);
  });

  it('keeps the smallest set reaching top_p probability', () => {
    // probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.8 keeps the first two exactly
    const logits = [0.5, 0.3, 0.15, 0.05].map(Math.log);
    const counts = histogram(logits, { topP: 0.8 }, 4_000);
    expect(counts[2]! + counts[3]!).toBe(0);
    expect(counts[0]! / 4_000).toBeCloseTo(0.5 / 0.8, 1);
    const wider = histogram(logits, { topP: 0.81 }, 4_000);
    expect(wider[2]!).toBeGreaterThan(0);
    expect(wider[3]!).toBe(0);
  });

  it('measures the top_p nucleus against the whole distribution, not only its likely part', () => {
    // weights 1, 0.9 and 100 tokens of 0.01 (total 2.9): top_p 0.5 needs 1.45, so the nucleus is
    // {a, b}, drawn 1 : 0.9; the 100 small tokens are never drawn.
    const logits = [1, 0.9, ...new Array<number>(100).fill(0.01)].map(Math.log);
    const draws = 4_000;
    const counts = histogram(logits, { topP: 0.5, topK: 0 }, draws);
    expect(counts[0]! + counts[1]!).toBe(draws);
    expect(counts[0]! / draws).toBeCloseTo(1 / 1.9, 1);
    expect(counts[1]! / draws).toBeCloseTo(0.9 / 1.9, 1);
  });

  it('applies top_p to what top_k keeps, renormalized', () => {
    // top_k 2 keeps weights 1 and 0.9; top_p 0.5 of their 1.9 is reached by the first alone.
    const logits = [1, 0.9, ...new Array<number>(100).fill(0.01)].map(Math.log);
    const counts = histogram(logits, { topP: 0.5, topK: 2 }, 1_000);
    expect(counts[0]!).toBe(1_000);
  });

  it('breaks top_k ties in favour of the lower token id', () => {
    const counts = histogram([1, 2, 2, 2, 0], { topK: 2 }, 2_000);
    expect(counts[1]! > 0 && counts[2]! > 0).toBe(true);
    expect(counts[0]! + counts[3]! + counts[4]!).toBe(0);
  });

  it('draws only among the k most likely tokens of a 151k vocabulary', () => {
    const random = new SeededRandom(5);
    const row = Float32Array.from({ length: 151_936 }, () => random.next() * 20);
    const top = new Set(topIndices(row, 50));
    const s = sampler({ topK: 50, temperature: 0.1 });
    for (let i = 0; i < 20; i++) expect(top.has(s.sample(row, 0, row.length).tokenId)).toBe(true);
  });

  it('drops tokens below min_p times the best probability', () => {
    const logits = [0.6, 0.3, 0.08, 0.02].map(Math.log);
    const counts = histogram(logits, { minP: 0.1 }, 4_000);
    expect(counts[3]!).toBe(0);
    expect(counts[2]!).toBeGreaterThan(0);
  });

  it('applies repetition penalty to prompt and output tokens, dividing positive and multiplying negative logits', () => {
    const s = sampler({ temperature: 0, repetitionPenalty: 2 }, [0]);
    // token 0 (in the prompt): 4 → 2, so token 1 (3) wins
    expect(s.sample(Float32Array.from([4, 3, -1]), 0, 3).tokenId).toBe(1);
    // token 1 is now an output too: 3 → 1.5; token 0 → 2 beats token 2 at 1.9
    expect(s.sample(Float32Array.from([4, 3, 1.9]), 0, 3).tokenId).toBe(0);
    const negative = sampler({ temperature: 0, repetitionPenalty: 2 }, [0]);
    expect(negative.sample(Float32Array.from([-1, -1.5]), 0, 2).tokenId).toBe(1);
  });

  it('adds the logit bias before the penalties, and reports the raw logprobs', () => {
    const row = Float32Array.from([Math.log(0.6), Math.log(0.3), Math.log(0.1)]);
    // -100 all but bans the argmax; +100 makes the least likely token win, greedy or drawn.
    expect(sampler({ temperature: 0, logitBias: [[0, -100]] }).sample(row, 0, 3).tokenId).toBe(1);
    expect(histogram([...row], { logitBias: [[2, 100]] }, 200)).toEqual([0, 0, 200]);
    const biased = sampler({ temperature: 0, logprobs: true, logitBias: [[0, -100]] }).sample(row, 0, 3);
    expect(biased.logprob).toBeCloseTo(Math.log(0.3), 5);
    // The bias comes first: token 0 (in the prompt) at 4 - 1 = 3, then halved by the repetition penalty to 1.5.
    expect(
      sampler({ temperature: 0, repetitionPenalty: 2, logitBias: [[0, -1]] }, [0]).sample(Float32Array.from([4, 1.6]), 0, 2).tokenId,
    ).toBe(1);
    expect(row[0]).toBeCloseTo(Math.log(0.6), 6); // the model's row is left as it was
  });

  it('subtracts frequency × count + presence for output tokens only', () => {
    const s = sampler({ temperature: 0, frequencyPenalty: 0.5, presencePenalty: 0.2 }, [1]);
    const row = Float32Array.from([2, 1.9, 0]);
    expect(s.sample(row, 0, 3).tokenId).toBe(0); // no outputs yet; prompt token 1 is not penalized
    expect(s.sample(row, 0, 3).tokenId).toBe(1); // 0 now at 2 - 0.7 = 1.3
    expect(s.sample(row, 0, 3).tokenId).toBe(0); // 0 at 1.3 vs 1 at 1.2
    expect(s.sample(row, 0, 3).tokenId).toBe(1); // 0 at 0.8 vs 1.2
  });

  it('returns raw-distribution logprobs and the top alternatives', () => {
    const logits = Float32Array.from([Math.log(0.1), Math.log(0.6), Math.log(0.3)]);
    const result = sampler({ temperature: 0, logprobs: true, topLogprobs: 2 }).sample(logits, 0, 3);
    expect(result.tokenId).toBe(1);
    expect(result.logprob).toBeCloseTo(Math.log(0.6), 5);
    expect(result.topLogprobs?.map((top) => top.tokenId)).toEqual([1, 2]);
    expect(result.topLogprobs?.[1]?.logprob).toBeCloseTo(Math.log(0.3), 5);
  });

  it('draws the same tokens for the same seed, independently of other samplers', () => {
    const row = Float32Array.from(Array.from({ length: 50 }, (_, i) => Math.sin(i)));
    const run = (interleave: boolean) => {
      const a = sampler({ temperature: 1.3, topP: 0.9 }, [], 11);
      const other = sampler({ temperature: 1 }, [], 99);
      const tokens: number[] = [];
      for (let i = 0; i < 30; i++) {
        if (interleave) other.sample(row, 0, 50);
        tokens.push(a.sample(row, 0, 50).tokenId);
      }
      return tokens;
    };
    expect(run(true)).toEqual(run(false));
  });
});

describe('sampling helpers', () => {
  it('computes log-sum-exp stably', () => {
    expect(logSumExp(Float32Array.from([1000, 1000]))).toBeCloseTo(1000 + Math.log(2), 6);
  });

  it('finds the k largest values, largest first', () => {
    expect(topIndices(Float32Array.from([1, 9, 3, 9, 7]), 3)).toEqual([1, 3, 4]);
    expect(argmax(Float32Array.from([Number.NaN, 1, 2]))).toBe(2);
  });
});
