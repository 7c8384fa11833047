import { fileURLToPath } from 'node:url';
import { afterEach, describe, expect, it } from 'vitest';
import { loadPromptModel, readPromptFiles } from '@sluice/model';
import { parseGenerateJob } from '@sluice/protocol';
import { engineSeed } from '../src/openai/engine-seed.js';
import { tokenCountBound } from '../src/token-count-bound.js';
import { modelTokenizer, type ModelTokenizer } from '../src/tokenizer-cache.js';
import { closeAppHarnesses, startAppHarness as start, type AppHarness } from './support/app-harness.js';

afterEach(closeAppHarnesses);

function post(h: AppHarness, path: string, body: string | Uint8Array) {
  return fetch(`${h.url}${path}`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body });
}

/** The job a chat request body (raw JSON text or bytes) becomes; throws when it is refused instead. */
async function jobOf(h: AppHarness, body: string | Uint8Array) {
  const job = h.nextJob();
  const refused = post(h, '/v1/chat/completions', body).then(async (res) => {
    throw new Error(`answered ${res.status} before a job: ${await res.text()}`);
  });
  return Promise.race([job, refused]);
}

const chat = (extra: string) => `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true${extra}}`;

describe('a seed past 2^53', () => {
  it('is taken as an int64, and reaches the worker as a job seed a job schema accepts, the same each time', async () => {
    const h = await start();
    // As JSON text: int64's max, 2^60, and int64's min.
    for (const seed of ['9223372036854775807', '1152921504606846976', '-9223372036854775808']) {
      const first = await jobOf(h, chat(`,"seed":${seed}`));
      const again = await jobOf(h, chat(`,"seed":${seed}`));
      expect(() => parseGenerateJob(first)).not.toThrow();
      expect(Number.isSafeInteger(first.sampling.seed)).toBe(true);
      expect(again.sampling.seed).toBe(first.sampling.seed);
    }
  });

  it('keeps a safe seed as it is', async () => {
    const h = await start();
    expect((await jobOf(h, chat(',"seed":9007199254740991'))).sampling.seed).toBe(9007199254740991);
    expect((await jobOf(h, chat(',"seed":-42'))).sampling.seed).toBe(-42);
  });

  it('gives distinct seeds distinct job seeds, round ones included', () => {
    const seeds = [2 ** 53, 2 ** 54, 2 ** 60, 2 ** 62, 2 ** 63, -(2 ** 53), -(2 ** 60), -(2 ** 63), 2 ** 53 + 2, 2 ** 60 + 256];
    const jobSeeds = new Set([0, 1, 2, 42, 256, ...seeds.map(engineSeed)]);
    expect(jobSeeds.size).toBe(5 + seeds.length);
    expect(seeds.map(engineSeed).every((seed) => Number.isSafeInteger(seed))).toBe(true);
  });

  it('refuses a seed outside int64, or not an integer, naming seed', async () => {
    const h = await start();
    for (const seed of ['9223372036854777856', '18446744073709551616', '-1e19', '1e300', '1.5']) {
      const res = await post(h, '/v1/chat/completions', chat(`,"seed":${seed}`));
      expect(res.status).toBe(400);
      expect(await res.json()).toMatchObject({ error: { param: 'seed', code: 'invalid_request', type: 'invalid_request_error' } });
    }
    expect(h.jobs).toEqual([]);
  });
});

describe('a body that starts with a UTF-8 byte order mark', () => {
  it('is read as the JSON after it', async () => {
    const h = await start();
    const body = Buffer.concat([Buffer.from([0xef, 0xbb, 0xbf]), Buffer.from(chat(''))]);
    expect((await jobOf(h, body)).input).toEqual({ kind: 'tokens', promptTokenIds: [104, 105] });
  });

  it('is read on /tokenize too', async () => {
    const h = await start();
    const res = await post(h, '/tokenize', Buffer.from('\ufeff{"model":"m","prompt":"hi"}'));
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ count: 2, tokens: [104, 105] });
  });

  it('is skipped once only: a second one is invalid JSON', async () => {
    const h = await start();
    const res = await post(h, '/v1/chat/completions', Buffer.from(`\ufeff\ufeff${chat('')}`));
    expect(res.status).toBe(400);
    expect(await res.json()).toMatchObject({ error: { code: 'invalid_json' } });
  });
});

describe('a resume cursor', () => {
  const resume = (h: AppHarness, query: string, headers: Record<string, string> = {}) =>
    fetch(`${h.url}/v1/chat/completions/chatcmpl-abc?stream=true${query}`, { headers });

  it('past 2^53 is refused with a 400 naming where it came from, not read rounded', async () => {
    const h = await start();
    const header = await resume(h, '', { 'Last-Event-ID': '9007199254740993' });
    expect(header.status).toBe(400);
    expect(await header.json()).toMatchObject({ error: { param: 'Last-Event-ID', code: 'invalid_request' } });
    const query = await resume(h, '&starting_after=9999999999999999');
    expect(query.status).toBe(400);
    expect(await query.json()).toMatchObject({ error: { param: 'starting_after', code: 'invalid_request' } });
  });

  it('up to 2^53 - 1 is taken (the stream is then looked up: unknown here)', async () => {
    const h = await start();
    const res = await resume(h, '', { 'Last-Event-ID': '9007199254740991' });
    expect(res.status).toBe(404);
    expect(await res.json()).toMatchObject({ error: { param: 'id' } });
  });
});

describe('POST /tokenize', () => {
  const tokenize = (h: AppHarness, body: Record<string, unknown>) => post(h, '/tokenize', JSON.stringify({ model: 'm', ...body }));

  it("answers up to the model's context, and refuses more with a 400 naming the field", async () => {
    // The harness's model: 100 tokens of context, one token per character.
    const h = await start();
    const fits = await tokenize(h, { prompt: 'x'.repeat(100) });
    expect(fits.status).toBe(200);
    expect(await fits.json()).toMatchObject({ count: 100, max_model_len: 100 });
    const prompt = await tokenize(h, { prompt: 'x'.repeat(101) });
    expect(prompt.status).toBe(400);
    expect(await prompt.json()).toMatchObject({
      error: { param: 'prompt', code: 'context_length_exceeded', message: expect.stringMatching(/maximum context length is 100 tokens/) },
    });
    const messages = await tokenize(h, { messages: [{ role: 'user', content: 'x'.repeat(150) }] });
    expect(messages.status).toBe(400);
    expect(await messages.json()).toMatchObject({ error: { param: 'messages', code: 'context_length_exceeded' } });
  });

  it('refuses a prompt whose byte length proves it too long without encoding it', async () => {
    const files = await readPromptFiles(fileURLToPath(new URL('../../../models/tiny', import.meta.url)));
    const tiny = modelTokenizer(
      loadPromptModel(files),
      100,
      tokenCountBound(JSON.parse(files.tokenizerJson), JSON.parse(files.tokenizerConfigJson)),
    );
    let encoded = 0;
    const counting: ModelTokenizer = {
      ...tiny,
      encodeText: ((prompt: string, fitsBelow?: number) => {
        const result = fitsBelow === undefined ? tiny.encodeText(prompt) : tiny.encodeText(prompt, fitsBelow);
        if (Array.isArray(result)) encoded++;
        return result;
      }) as ModelTokenizer['encodeText'],
    };
    const h = await start({}, { tokenizer: counting });
    // 3 MiB: seconds of BPE on the gateway's thread, were it encoded.
    const res = await tokenize(h, { prompt: 'The quick brown fox jumps over the lazy dog. '.repeat(70_000) });
    expect(res.status).toBe(400);
    expect(await res.json()).toMatchObject({
      error: { param: 'prompt', code: 'context_length_exceeded', message: expect.stringMatching(/at least \d+ tokens/) },
    });
    expect(encoded).toBe(0);
    const fits = await tokenize(h, { prompt: 'The quick brown fox.' });
    expect(fits.status).toBe(200);
    expect(encoded).toBe(1);
  });
});
