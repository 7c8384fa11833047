import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultModelsRoot } from '@sluice/model';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import type { GatewayProcess } from './support/sluice.js';
import { postRaw } from './support/sse.js';

interface ErrorBody {
  error: { message: string; type: string; param: string | null; code: string };
}

/** A template that refuses a system message, as Gemma's and Mistral's do. */
const STRICT_TEMPLATE =
  "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" +
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}" +
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// The gateway tokenizes with the card the worker published: a frozen worker cannot delay a refusal.
describe.skipIf(FAKE_ENGINE)('refusals while every worker is frozen (SIGSTOP)', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let strictDir: string;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A frozen worker must stay registered while the test runs.
    const first = await cluster.worker({ WORKER_TTL_MS: '120000' });
    strictDir = await mkdtemp(join(tmpdir(), 'sluice-strict-'));
    await cp(join(defaultModelsRoot(), 'tiny'), strictDir, { recursive: true });
    const configPath = join(strictDir, 'tokenizer_config.json');
    const config = JSON.parse(await readFile(configPath, 'utf8')) as Record<string, unknown>;
    await writeFile(configPath, JSON.stringify({ ...config, chat_template: STRICT_TEMPLATE }));
    const strict = await cluster.worker({ WORKER_TTL_MS: '120000', MODEL_DIR: strictDir, MODEL_ID: 'strict' });
    gateway = await cluster.gateway({ HEADERS_WAIT_MS: '0' });
    for (const worker of [first, strict]) worker.process.signal('SIGSTOP');
  });

  afterAll(async () => {
    for (const worker of cluster?.workers ?? []) worker.process.signal('SIGCONT');
    await cluster?.stop();
    if (strictDir !== undefined) await rm(strictDir, { recursive: true, force: true });
  });

  async function refused(path: string, body: unknown): Promise<{ status: number; error: ErrorBody['error'] }> {
    const res = await postRaw(`${gateway.url}${path}`, body);
    expect(res.headers.get('content-type')).toMatch(/^application\/json/);
    return { status: res.status, error: (res.json as ErrorBody).error };
  }

  for (const stream of [true, false]) {
    it(`answers max_tokens past the context with 400 (stream: ${stream})`, async () => {
      const { status, error } = await refused('/v1/chat/completions', {
        model: MODEL,
        messages: [{ role: 'user', content: 'Hello' }],
        max_tokens: 100_000,
        stream,
      });
      expect(status).toBe(400);
      expect(error).toMatchObject({ code: 'context_length_exceeded', param: 'max_tokens', type: 'invalid_request_error' });
      expect(error.message).toMatch(/maximum context length/);
    });

    it(`answers a prompt past the context with 400 (stream: ${stream})`, async () => {
      const { status, error } = await refused('/v1/completions', { model: MODEL, prompt: 'word '.repeat(5000), stream });
      expect(status).toBe(400);
      expect(error).toMatchObject({ code: 'context_length_exceeded', param: 'prompt' });
    });

    it(`answers what the chat template refuses with 400, in the template's words (stream: ${stream})`, async () => {
      const { status, error } = await refused('/v1/chat/completions', {
        model: 'strict',
        messages: [
          { role: 'system', content: 'Be brief.' },
          { role: 'user', content: 'Hello' },
        ],
        stream,
      });
      expect(status).toBe(400);
      expect(error).toMatchObject({ code: 'invalid_request', param: 'messages', message: 'System role not supported' });
    });

    it(`answers an unknown model with 404 (stream: ${stream})`, async () => {
      const { status, error } = await refused('/v1/chat/completions', {
        model: 'nope',
        messages: [{ role: 'user', content: 'x' }],
        stream,
      });
      expect(status).toBe(404);
      expect(error).toMatchObject({ code: 'model_not_found', param: 'model' });
    });

    it(`answers token ids outside the vocabulary with 400 (stream: ${stream})`, async () => {
      const { status, error } = await refused('/v1/completions', { model: MODEL, prompt: [1, 2, 10_000_000], stream });
      expect(status).toBe(400);
      expect(error).toMatchObject({ code: 'invalid_request', param: 'prompt' });
    });
  }
});
