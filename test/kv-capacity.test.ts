import { describe, expect, it } from 'vitest';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import { postRaw } from './support/sse.js';

/**
 * A worker whose KV cache (MAX_CACHED_TOKENS) is smaller than the model's context offers that much
 * context and no more: the gateways advertise it, refuse what cannot fit before the 200, and fill a
 * default max_tokens up to it (the worker used to advertise the model's 2,048 tokens and refuse such
 * requests after the 200, every chat without max_tokens among them).
 */
describe.skipIf(FAKE_ENGINE)('a KV cache smaller than the context', () => {
  it('is the context the gateway advertises, refuses beyond and fills by default', async () => {
    const cluster = await Cluster.start();
    try {
      await cluster.worker({ MAX_BATCH_SIZE: '4', MAX_CACHED_TOKENS: '256', MODEL_ID: MODEL });
      const gateway = await cluster.gateway();
      const models = (await (await fetch(`${gateway.url}/v1/models`)).json()) as { data: Array<{ id: string; max_model_len: number }> };
      expect(models.data.find((model) => model.id === MODEL)?.max_model_len).toBe(256);

      const tooLong = await postRaw(`${gateway.url}/v1/completions`, {
        model: MODEL,
        prompt: 'Once upon a time',
        max_tokens: 300,
        stream: true,
      });
      expect(tooLong.status, cluster.logs()).toBe(400);
      expect(tooLong.json).toMatchObject({ error: { code: 'context_length_exceeded', param: 'max_tokens' } });

      const filled = await postRaw(`${gateway.url}/v1/chat/completions`, {
        model: MODEL,
        messages: [{ role: 'user', content: 'Hello there' }],
        ignore_eos: true,
        temperature: 0,
      });
      expect(filled.status, cluster.logs()).toBe(200);
      const body = filled.json as { choices: Array<{ finish_reason: string }>; usage: { total_tokens: number } };
      expect(body.choices[0]!.finish_reason).toBe('length');
      expect(body.usage.total_tokens).toBe(256);

      // n choices share the cache: a default max_tokens fills each one's share, ...
      const shared = await postRaw(`${gateway.url}/v1/chat/completions`, {
        model: MODEL,
        messages: [{ role: 'user', content: 'Hello there' }],
        n: 2,
        ignore_eos: true,
        temperature: 0,
      });
      expect(shared.status, cluster.logs()).toBe(200);
      const both = shared.json as {
        choices: Array<{ finish_reason: string }>;
        usage: { prompt_tokens: number; completion_tokens: number };
      };
      expect(both.choices.map((choice) => choice.finish_reason)).toEqual(['length', 'length']);
      expect(both.usage.completion_tokens).toBe(2 * (128 - both.usage.prompt_tokens));
      // ... and choices that cannot all fit are refused before the 200, naming what the client sent.
      const crowded = await postRaw(`${gateway.url}/v1/completions`, {
        model: MODEL,
        prompt: 'Once upon a time',
        n: 2,
        max_tokens: 200,
        stream: true,
      });
      expect(crowded.status, cluster.logs()).toBe(400);
      expect(crowded.json).toMatchObject({ error: { code: 'context_length_exceeded', param: 'max_tokens' } });
    } finally {
      await cluster.stop();
    }
  }, 120_000);
});
