import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { generateTinyModel } from '@sluice/model';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import { sleep } from './support/processes.js';
import { checkChunkSequence, postRaw } from './support/sse.js';

/**
 * A model directory exported in the GroupQueryAttention form (onnxruntime's `com.microsoft` op, as
 * onnxruntime-genai's builder writes) is served end to end: gateway, Redis, worker, engine. The
 * same weights in the plain form, served the same way, give the same text for the same requests,
 * alone and concurrently.
 */
const PROMPTS = [
  'Once upon a time',
  'The sea was calm and',
  'A small red fox',
  'Bread is made of',
  'Two old friends met',
  'Rain on a tin roof',
];

/** Texts of every prompt served by a worker on `modelDir`: streamed concurrently, then one alone (stream: false). */
async function serve(modelDir: string | undefined): Promise<{ concurrent: string[]; alone: string }> {
  const cluster = await Cluster.start();
  try {
    await cluster.worker({ MAX_BATCH_SIZE: '8', MODEL_ID: MODEL, ...(modelDir === undefined ? {} : { MODEL_DIR: modelDir }) });
    const gateway = await cluster.gateway();
    const body = (prompt: string, maxTokens: number) => ({ model: MODEL, prompt, max_tokens: maxTokens, temperature: 0 });
    const concurrent = await Promise.all(
      PROMPTS.map(async (prompt, i) => {
        await sleep(i * 20);
        const res = await postRaw(`${gateway.url}/v1/completions`, { ...body(prompt, 24 + i * 9), stream: true });
        expect(res.status, cluster.logs()).toBe(200);
        return checkChunkSequence(res.items, 'completion', false).text;
      }),
    );
    const single = await postRaw(`${gateway.url}/v1/completions`, body(PROMPTS[0]!, 40));
    expect(single.status).toBe(200);
    const alone = (single.json as { choices: Array<{ text: string }> }).choices[0]!.text;
    return { concurrent, alone };
  } finally {
    await cluster.stop();
  }
}

describe.skipIf(FAKE_ENGINE)('a GroupQueryAttention model directory', () => {
  let gqaDir: string;

  beforeAll(async () => {
    gqaDir = await mkdtemp(join(tmpdir(), 'sluice-e2e-gqa-'));
    await generateTinyModel({ preset: 'tiny', outDir: gqaDir, attention: 'gqa' });
  });

  afterAll(async () => {
    if (gqaDir !== undefined) await rm(gqaDir, { recursive: true, force: true });
  });

  it('is served through gateway and worker with the plain form’s text, alone and concurrently', async () => {
    const gqa = await serve(gqaDir);
    const plain = await serve(undefined);
    expect(gqa.concurrent.every((text) => text.length > 0)).toBe(true);
    expect(gqa.concurrent).toEqual(plain.concurrent);
    expect(gqa.alone).toEqual(plain.alone);
  });
});
