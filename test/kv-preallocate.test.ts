import { describe, expect, it } from 'vitest';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import { waitFor } from './support/processes.js';
import { checkChunkSequence, postRaw } from './support/sse.js';

/**
 * KV_PREALLOCATE=1: the worker reserves its KV cache before it takes jobs, says how much in its
 * `worker ready` line, and serves the same text as a worker without it (concurrent streams).
 */
const PROMPTS = ['Once upon a time', 'The sea was calm and', 'A small red fox', 'Bread is made of'];

async function serve(env: Record<string, string>): Promise<{ texts: string[]; ready: Record<string, unknown> }> {
  const cluster = await Cluster.start();
  try {
    const worker = await cluster.worker({ MAX_BATCH_SIZE: '8', MODEL_ID: MODEL, LOG_LEVEL: 'info', ...env });
    const ready = await waitFor('the worker ready line', async () => {
      const line = worker.process
        .output()
        .split('\n')
        .find((text) => text.includes('"worker ready"'));
      return line === undefined ? undefined : (JSON.parse(line) as Record<string, unknown>);
    });
    const gateway = await cluster.gateway();
    const texts = await Promise.all(
      PROMPTS.map(async (prompt, i) => {
        const res = await postRaw(`${gateway.url}/v1/completions`, {
          model: MODEL,
          prompt,
          max_tokens: 20 + i * 7,
          temperature: 0,
          stream: true,
        });
        expect(res.status, cluster.logs()).toBe(200);
        return checkChunkSequence(res.items, 'completion', false).text;
      }),
    );
    return { texts, ready };
  } finally {
    await cluster.stop();
  }
}

describe.skipIf(FAKE_ENGINE)('KV_PREALLOCATE', () => {
  it('reserves MAX_CACHED_TOKENS slots of KV cache at start, says so, and serves the same text', async () => {
    // The tiny model: 2 layers × key and value × 2 KV heads × 16 dims × 4 bytes = 512 bytes a slot.
    const reserved = await serve({ KV_PREALLOCATE: '1', MAX_CACHED_TOKENS: '8192' });
    expect(reserved.ready.kvReservedMiB).toBe(4);
    const plain = await serve({ MAX_CACHED_TOKENS: '8192' });
    expect(plain.ready.kvReservedMiB).toBe(0);
    expect(reserved.texts).toEqual(plain.texts);
    expect(new Set(reserved.texts).size).toBe(PROMPTS.length);
  }, 120_000);
});
