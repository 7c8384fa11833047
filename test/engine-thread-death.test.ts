import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import { freezeMidAnswers, retryMidAnswer, thaw } from './support/mid-answer.js';
import { sleep, waitFor } from './support/processes.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * A worker whose engine thread dies, and only that thread (the process lives on): it used to stay
 * registered and healthy, ending its streams with `internal` errors and taking every new job only to
 * fail it. Real processes: redis-server, a gateway, two workers (tiny model), the official `openai`
 * client; the thread is ended from outside through the Node inspector (`--inspect`), as an uncaught
 * error or a `process.exit` in the thread would end it, while its answers are frozen mid-way (SIGSTOP).
 */

const WORKER_ENV = { WORKER_HEARTBEAT_MS: '250', WORKER_TTL_MS: '1500', LOCK_DURATION_MS: '30000', LOG_LEVEL: 'warn' };
const GATEWAY_ENV = { REGISTRY_POLL_MS: '200', IDLE_TIMEOUT_MS: '120000' };
const EXIT_THREAD = fileURLToPath(new URL('./support/exit-engine-thread.mjs', import.meta.url));
const MAX_TOKENS = 600;

interface Answer {
  text: string;
  finish: string | null;
  error: unknown;
}

/** A greedy stream through the official client; `jobId` is known from its first chunk. */
function startStream(client: OpenAI, i: number, maxTokens = MAX_TOKENS): { readonly jobId: string; answer: Promise<Answer> } {
  let jobId = '';
  const answer = (async (): Promise<Answer> => {
    const got: Answer = { text: '', finish: null, error: undefined };
    try {
      const stream = await client.chat.completions.create({
        model: MODEL,
        messages: [{ role: 'user', content: `Thread ${i}: tell me about the ${['sea', 'fox', 'rain'][i % 3]}.` }],
        max_tokens: maxTokens,
        temperature: 0,
        stream: true,
        ...({ ignore_eos: true } as object),
      });
      for await (const chunk of stream) {
        jobId ||= chunk.id.replace(/^chatcmpl-/, '');
        got.text += chunk.choices[0]?.delta.content ?? '';
        got.finish = chunk.choices[0]?.finish_reason ?? got.finish;
      }
    } catch (error) {
      got.error = error;
    }
    return got;
  })();
  return {
    get jobId() {
      return jobId;
    },
    answer,
  };
}

/** The inspector client of exit-engine-thread.mjs, attached to the worker's engine thread. */
async function attachToEngineThread(worker: WorkerProcess): Promise<{ child: ChildProcessWithoutNullStreams; output: () => string }> {
  const url = await waitFor(
    'the worker inspector URL',
    async () => /Debugger listening on (ws:\/\/\S+)/.exec(worker.process.output())?.[1],
  );
  const child = spawn(process.execPath, ['--experimental-websocket', '--no-warnings', EXIT_THREAD, url], { stdio: 'pipe' });
  let output = '';
  child.stdout.setEncoding('utf8').on('data', (text: string) => (output += text));
  child.stderr.setEncoding('utf8').on('data', (text: string) => (output += text));
  await waitFor('the engine thread attached', async () => {
    if (child.exitCode !== null) throw new Error(`exit-engine-thread.mjs exited: ${output}`);
    return output.includes('ready') ? true : undefined;
  });
  return { child, output: () => output };
}

describe.skipIf(FAKE_ENGINE)('when a worker engine thread dies', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let client: OpenAI;

  beforeAll(async () => {
    cluster = await Cluster.start();
    gateway = await cluster.gateway(GATEWAY_ENV, { waitReady: false });
    client = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: 'none', maxRetries: 0, timeout: 120_000 });
  }, 120_000);

  afterAll(async () => {
    for (const worker of cluster?.workers ?? []) worker.process.signal('SIGCONT');
    await cluster?.stop();
  });

  it('exits at once (code 1) when the thread dies between runs, instead of failing every job it takes', async () => {
    const survivor = await cluster.worker(WORKER_ENV);
    const victim = await cluster.worker({ ...WORKER_ENV, NODE_OPTIONS: '--inspect=127.0.0.1:0' });
    await waitFor('the gateway ready', async () => ((await gateway.get('/readyz')).status === 200 ? true : undefined));
    const inspector = await attachToEngineThread(victim);
    try {
      inspector.child.stdin.write('exit\n');
      await waitFor('the thread gone', async () => (inspector.output().includes('thread gone') ? true : undefined));
      const exited = await Promise.race([victim.process.exited, sleep(30_000).then(() => 'still running')]);
      expect(exited, `the victim exits by itself:\n${victim.process.output().slice(-2000)}`).toEqual({ code: 1, signal: null });
      expect(victim.process.output()).toMatch(/the engine thread died/);
    } finally {
      inspector.child.kill();
    }
    // Every request is answered (by the survivor): none goes to a worker that can only fail it.
    const answers = await Promise.all([0, 1, 2, 3, 4, 5].map((i) => startStream(client, i, 8).answer));
    for (const answer of answers) expect(answer.error).toBeUndefined();
    expect((await survivor.health()).processed).toBeGreaterThanOrEqual(answers.length);
    await survivor.process.stop();
  }, 240_000);

  it('loses no answer when the thread dies mid-answer: its streams continue token-identical on another worker', async () => {
    const victim = await cluster.worker({ ...WORKER_ENV, NODE_OPTIONS: '--inspect=127.0.0.1:0' });
    await waitFor('the gateway ready', async () => ((await gateway.get('/readyz')).status === 200 ? true : undefined));
    // The answers of an undisturbed run (greedy: the same on any worker, whatever shares its batch).
    const reference = await Promise.all([0, 1, 2].map((i) => startStream(client, i).answer));
    for (const answer of reference) expect(answer.error).toBeUndefined();

    const inspector = await attachToEngineThread(victim);
    const redis = cluster.redis.client();
    try {
      const streams = await retryMidAnswer('the streams', async () => {
        const runs = [0, 1, 2].map((i) => startStream(client, i));
        await waitFor('every stream under way', async () => (runs.every((r) => r.jobId !== '') ? true : undefined));
        if ((await freezeMidAnswers([victim], redis, runs, MAX_TOKENS)) !== null) return runs;
        await Promise.all(runs.map((r) => r.answer));
        return undefined;
      });
      // Frozen mid-answer: a worker to continue on, then the engine thread's end, queued in the
      // inspector's socket, runs as soon as the victim runs again.
      const survivor = await cluster.worker(WORKER_ENV);
      inspector.child.stdin.write('exit\n');
      await waitFor('the exit sent', async () => (inspector.output().includes('sent') ? true : undefined));
      thaw([victim]);

      // A thread ended inside an onnxruntime run takes the process down with it (onnxruntime-node
      // throws into a terminating thread: SIGABRT); one ended between runs exits it (code 1). Either
      // way the process is gone, and its streams are continued elsewhere.
      const exited = await Promise.race([victim.process.exited, sleep(30_000).then(() => 'still running')]);
      expect([JSON.stringify({ code: 1, signal: null }), JSON.stringify({ code: null, signal: 'SIGABRT' })]).toContain(
        JSON.stringify(exited),
      );
      console.log(`engine thread ended mid-answer: the worker process ended with ${JSON.stringify(exited)}`);

      const answers = await Promise.all(streams.map((s) => s.answer));
      answers.forEach((answer, i) => {
        expect(answer.error, `stream ${i}`).toBeUndefined();
        expect([answer.text, answer.finish], `stream ${i}`).toEqual([reference[i]!.text, reference[i]!.finish]);
      });
      expect((await survivor.health()).processed).toBeGreaterThanOrEqual(streams.length);
    } finally {
      redis.disconnect();
      inspector.child.kill();
      thaw([victim]);
    }
  }, 240_000);
});
