import { Redis } from 'ioredis';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { EngineEvent, GenerateRequest } from '@sluice/engine';
import {
  decodeGatewayMessage,
  encodeControlMessage,
  encodeRequestMeta,
  LOG_FIELD,
  redisNames,
  type GatewayEntry,
  type GenerateJob,
} from '@sluice/protocol';
import { startRedis, type RedisServer } from '../../../test/support/redis-server.js';
import { waitFor } from '../../../test/support/processes.js';
import { ControlListener } from '../src/control-listener.js';
import { JobProcessor } from '../src/processor.js';
import { StepRouter } from '../src/step-router.js';

const names = redisNames('t');
let server: RedisServer;
let redis: Redis;

beforeAll(async () => {
  server = await startRedis();
  redis = server.client();
});
afterAll(async () => {
  redis?.disconnect();
  await server?.stop();
});

/** A processor and router on the real Redis around an engine the test drives step by step. */
async function harness(connection: Redis = redis, refuse?: (request: GenerateRequest) => Error | undefined) {
  const submitted: Array<{ request: GenerateRequest; signal: AbortSignal | undefined }> = [];
  const router = new StepRouter(connection, { workerId: 'w1', names, retentionMs: 60_000, maxLogEntries: 1000 }, pino({ level: 'silent' }));
  const subscriber = server.client();
  const controls = new ControlListener(
    subscriber,
    names.controlChannel,
    router,
    pino({ level: 'silent' }),
    connection,
    names.cancelMarkerKey,
  );
  const finished: Array<{ finishReason: string; completionTokens: number }> = [];
  const lines: Array<Record<string, unknown>> = [];
  const processor = new JobProcessor({
    engine: {
      info: {
        modelId: 'm',
        maxContextLength: 100,
        maxBatchSize: 4,
        maxCachedTokens: 400,
        executionProvider: 'cpu',
        kvReservedBytes: 0,
        kvCache: 'engine-owned',
        groupQueryAttention: 'none',
        splitAttentionLayers: 0,
        intraOpThreads: 1,
      },
      submit: (request, signal) => {
        const refusal = refuse?.(request);
        if (refusal !== undefined) throw refusal;
        submitted.push({ request, signal });
      },
    },
    router,
    controls,
    redis,
    names,
    workerId: 'w1',
    // Info lines kept as objects: a request's `request finished` line carries its TTFT timing.
    logger: pino({ level: 'info' }, { write: (line: string) => void lines.push(JSON.parse(line) as Record<string, unknown>) }),
    hooks: { requestFinished: (s) => finished.push({ finishReason: s.finishReason, completionTokens: s.usage.completionTokens }) },
  });
  /** Feeds one engine step and waits for its pipeline. */
  const step = async (events: Array<[string, EngineEvent]>) => {
    router.onEvents(events);
    await router.drained();
  };
  /**
   * Waits until `count` jobs passed their checks (accepted, running). The engine gets a first attempt
   * before its checks answer, so a submit alone does not say the job was accepted.
   */
  const accepted = (count: number) =>
    waitFor(`${count} accepted`, () => (processor.counters.running === count && submitted.length >= count ? true : undefined));
  return { processor, router, controls, submitted, finished, lines, step, accepted, close: () => subscriber.quit() };
}

let jobCount = 0;
function job(channel: string, extra: Partial<GenerateJob> = {}): GenerateJob {
  jobCount++;
  return {
    requestId: `job-${jobCount}`,
    correlationId: `client-${jobCount}`,
    channel,
    model: 'm',
    input: { kind: 'tokens', promptTokenIds: [1, 2, 3] },
    sampling: { maxTokens: 8 },
    defaultMaxTokens: 16,
    resumeGraceMs: 0,
    enqueuedAt: Date.now(),
    deadlineAt: Date.now() + 60_000,
    ...extra,
  };
}

async function writeMeta(j: GenerateJob, fields: Partial<Record<string, string>> = {}): Promise<void> {
  const meta = encodeRequestMeta({
    channel: j.channel,
    graceMs: j.resumeGraceMs,
    attempt: 1,
    enqueuedAt: j.enqueuedAt,
    deadlineAt: j.deadlineAt,
    format: { endpoint: 'completion', model: 'm', created: 1, includeUsage: false, n: 1, maxTokensParam: 'max_tokens' },
  });
  await redis.hset(names.metaKey(j.requestId), { ...meta, ...fields });
}

async function logOf(requestId: string): Promise<GatewayEntry[]> {
  const range = await redis.xrange(names.logKey(requestId), '-', '+');
  return range.map(([, fields]) => JSON.parse(fields[fields.indexOf(LOG_FIELD) + 1]!) as GatewayEntry);
}

/** Subscribes to `channel` and collects its messages. */
/** Writes `entries` into the request's token log as a worker would. */
async function appendLog(requestId: string, entries: ReadonlyArray<{ seq: number }>): Promise<void> {
  for (const entry of entries) await redis.xadd(names.logKey(requestId), `${entry.seq}-1`, LOG_FIELD, JSON.stringify(entry));
}

/** A continuation's meta (attempt 2) and what a lost worker wrote before: `accepted` and one token of choice 0. */
async function lostWorkersStart(j: GenerateJob) {
  await writeMeta(j, { attempt: '2' });
  const sent = [
    { requestId: j.requestId, seq: 0, type: 'accepted', workerId: 'w-lost', promptTokens: 3, seed: 7 },
    { requestId: j.requestId, seq: 1, type: 'text-delta', index: 0, text: 'a', tokenIds: [5], tokens: 1 },
  ];
  await appendLog(j.requestId, sent);
  return sent;
}

async function listen(channel: string) {
  const sub = server.client();
  const messages: GatewayEntry[][] = [];
  sub.on('message', (_c: string, raw: string) => messages.push(decodeGatewayMessage(raw).entries));
  await sub.subscribe(channel);
  await redis.set(names.gatewayAliveKey(channel), '1');
  return { messages, close: () => sub.quit() };
}

const finish = (completionTokens: number): EngineEvent => ({
  type: 'finish',
  usage: { promptTokens: 3, completionTokens },
  timings: { queueMs: 1, prefillMs: 1, firstTokenMs: 1 },
});

describe('the worker routes each engine step as a whole', () => {
  it('logs every entry with its token ids and publishes the same entries without them, carrying held-back tokens to the next delta', async () => {
    const h = await harness();
    const live = await listen('gw-a');
    const j = job('gw-a');
    await writeMeta(j);
    const done = h.processor.process(j, 1);
    await h.accepted(1);
    await h.step([
      [j.requestId, { type: 'text-delta', index: 0, tokenIds: [10], text: 'a' }],
      // Two tokens that are parts of one character: no text yet.
      [j.requestId, { type: 'text-delta', index: 0, tokenIds: [11], text: '' }],
    ]);
    await h.step([
      [j.requestId, { type: 'text-delta', index: 0, tokenIds: [12], text: 'é' }],
      // A trailing partial character the detokenizer never releases.
      [j.requestId, { type: 'text-delta', index: 0, tokenIds: [13], text: '' }],
      [j.requestId, { type: 'text-delta', index: 0, tokenIds: [14], text: '' }],
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'length' }],
      [j.requestId, finish(5)],
    ]);
    await done;
    const log = await logOf(j.requestId);
    expect(log.map((e) => e.seq)).toEqual([0, 1, 2, 3, 4, 5]);
    expect(log.map((e) => e.type)).toEqual(['accepted', 'text-delta', 'text-delta', 'text-delta', 'text-end', 'finish']);
    const deltas = log.filter((e) => e.type === 'text-delta');
    expect(deltas.map((e) => [e.text, e.tokens, e.tokenIds])).toEqual([
      ['a', 1, [10]],
      ['é', 2, [11, 12]],
      ['', 2, [13, 14]],
    ]);
    expect(h.finished).toEqual([{ finishReason: 'length', completionTokens: 5 }]);
    await waitFor('live messages', () => (live.messages.flat().length === 6 ? true : undefined));
    // Live, the same entries without their token ids: only a continuation reads them, from the log.
    expect(live.messages.flat()).toEqual(log.map((e) => (e.type === 'text-delta' ? { ...e, tokenIds: undefined } : e)));
    expect(live.messages.flat().some((e) => 'tokenIds' in e)).toBe(false);
    // The TTL starts when the request ends: the retention, not the deadline.
    const ttl = await redis.pttl(names.logKey(j.requestId));
    expect(ttl).toBeGreaterThan(50_000);
    expect(ttl).toBeLessThanOrEqual(60_000);
    await live.close();
    await h.close();
  });

  it('settles a job only once Redis has its last entries (a job gone from BullMQ means a log that ends)', async () => {
    const connection = server.client();
    const h = await harness(connection);
    const live = await listen('gw-settle');
    const j = job('gw-settle');
    await writeMeta(j);
    let settled = false;
    const done = h.processor.process(j, 1).then(() => (settled = true));
    await h.accepted(1);
    await h.step([[j.requestId, { type: 'text-delta', index: 0, tokenIds: [10], text: 'a' }]]);
    // (Held until the job's checks answer, then written.)
    await waitFor('the first entries logged', async () => ((await logOf(j.requestId)).length === 2 ? true : undefined));
    // The router's connection holds what it is given (as a backlog Redis has not read yet would).
    connection.stream.cork();
    h.router.onEvents([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'length' }],
      [j.requestId, finish(1)],
    ]);
    await new Promise((resolve) => setTimeout(resolve, 100));
    expect(settled).toBe(false);
    expect((await logOf(j.requestId)).map((e) => e.type)).toEqual(['accepted', 'text-delta']);
    connection.stream.uncork();
    await done;
    expect((await logOf(j.requestId)).map((e) => e.type)).toEqual(['accepted', 'text-delta', 'text-end', 'finish']);
    await live.close();
    await h.close();
    connection.disconnect();
  });

  it("logs the worker's side of the TTFT breakdown with the request: pickup, submit and checks, first step, pipeline answered", async () => {
    const h = await harness();
    const live = await listen('gw-t');
    const j = job('gw-t');
    await writeMeta(j);
    const done = h.processor.process(j, 1);
    await h.accepted(1);
    await h.step([[j.requestId, { type: 'text-delta', index: 0, tokenIds: [1], text: 'x' }]]);
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'length' }],
      [j.requestId, finish(1)],
    ]);
    await done;
    const line = h.lines.find((l) => l['msg'] === 'request finished' && l['jobId'] === j.requestId);
    const t = line?.['timing'] as Record<string, number>;
    expect(Math.abs(t['pickedUpAt']! - Date.now())).toBeLessThan(60_000);
    // The engine gets a first attempt before the checks answer; the first step is written once both are in.
    expect(0).toBeLessThanOrEqual(t['submittedMs']!);
    expect(t['submittedMs']).toBeLessThanOrEqual(t['checkedMs']!);
    expect(t['submittedMs']).toBeLessThanOrEqual(t['firstStepMs']!);
    expect(t['checkedMs']).toBeLessThanOrEqual(t['publishedMs']!);
    expect(t['firstStepMs']).toBeLessThanOrEqual(t['publishedMs']!);
    expect(t['engineFirstTokenMs']).toBe(1);
    await live.close();
    await h.close();
  });

  it('sends one message per gateway per step with the entries of all its requests', async () => {
    const h = await harness();
    const a = await listen('gw-one');
    const b = await listen('gw-two');
    const jobs = [job('gw-one'), job('gw-one'), job('gw-two')];
    const runs = jobs.map((j) => h.processor.process(j, 1));
    await h.accepted(3);
    await h.step(jobs.map((j) => [j.requestId, { type: 'text-delta', index: 0, tokenIds: [1], text: 'x' }]));
    await h.step(
      jobs.flatMap((j): Array<[string, EngineEvent]> => [
        [j.requestId, { type: 'text-end', index: 0, finishReason: 'stop' }],
        [j.requestId, finish(1)],
      ]),
    );
    await Promise.all(runs);
    await waitFor('messages', () => (a.messages.flat().length === 8 && b.messages.flat().length === 4 ? true : undefined));
    // accepted (one message per job start: they start apart), then one message per step per gateway.
    expect(a.messages.slice(-2).map((m) => m.map((e) => e.type))).toEqual([
      ['text-delta', 'text-delta'],
      ['text-end', 'finish', 'text-end', 'finish'],
    ]);
    await a.close();
    await b.close();
    await h.close();
  });
  it('makes one Redis write per engine step: one command with an append per request and a publish per gateway', async () => {
    // The router's own connection, so that every command it sends is seen.
    const connection = server.client();
    const sent: string[] = [];
    const send = connection.sendCommand.bind(connection);
    connection.sendCommand = (command: { name: string }, ...rest: unknown[]) => {
      sent.push(command.name);
      return (send as (...a: unknown[]) => unknown)(command, ...rest);
    };
    const h = await harness(connection);
    const a = await listen('gw-p1');
    const b = await listen('gw-p2');
    const jobs = [job('gw-p1'), job('gw-p1'), job('gw-p2')];
    const runs = jobs.map((j) => h.processor.process(j, 1));
    await h.accepted(3);
    await h.router.drained();
    const steps: Array<Array<[string, EngineEvent]>> = [
      jobs.map((j) => [j.requestId, { type: 'text-delta', index: 0, tokenIds: [1], text: 'x' }]),
      jobs.map((j) => [j.requestId, { type: 'text-delta', index: 0, tokenIds: [2, 3], text: 'yz' }]),
      jobs.flatMap((j): Array<[string, EngineEvent]> => [
        [j.requestId, { type: 'text-end', index: 0, finishReason: 'stop' }],
        [j.requestId, finish(3)],
      ]),
    ];
    // What reaches the socket: Node hands a corked socket's queued chunks to `_writev` in one call
    // (one writev syscall); a lone chunk goes to `_write`.
    const socket = connection.stream as typeof connection.stream & Record<'_write' | '_writev', (...a: unknown[]) => unknown>;
    let writes = 0;
    for (const method of ['_write', '_writev'] as const) {
      const original = socket[method].bind(socket);
      socket[method] = (...a: unknown[]) => {
        writes++;
        return original(...a);
      };
    }
    for (const events of steps) {
      writes = 0;
      sent.length = 0;
      await h.step(events);
      expect(writes).toBe(1);
      // The entries script (EVALSHA, or EVAL the first time the connection runs it): the step's appends and publishes.
      expect(sent.filter((c) => c !== 'script').map((c) => (c === 'eval' ? 'evalsha' : c))).toEqual(['evalsha']);
    }
    await Promise.all(runs);
    await a.close();
    await b.close();
    await h.close();
    connection.disconnect();
  });
});

describe('a first attempt starts in the engine while its checks are out', () => {
  it('writes what the engine made before the checks answered only after them, accepted first, in one pipeline', async () => {
    const h = await harness();
    const live = await listen('gw-early');
    const j = job('gw-early');
    await writeMeta(j);
    const done = h.processor.process(j, 1);
    // Submitted synchronously, before the checks' round trip can have answered.
    expect(h.submitted.map((s) => s.request.id)).toEqual([j.requestId]);
    h.router.onEvents([
      [j.requestId, { type: 'scheduled' }],
      [j.requestId, { type: 'text-delta', index: 0, tokenIds: [5], text: 'early' }],
    ]);
    expect(h.processor.counters.running).toBe(0);
    await h.accepted(1);
    await h.router.drained();
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'length' }],
      [j.requestId, finish(1)],
    ]);
    await done;
    const log = await logOf(j.requestId);
    expect(log.map((e) => [e.seq, e.type])).toEqual([
      [0, 'accepted'],
      [1, 'scheduled'],
      [2, 'text-delta'],
      [3, 'text-end'],
      [4, 'finish'],
    ]);
    await waitFor('live messages', () => (live.messages.length === 2 ? true : undefined));
    expect(live.messages[0]!.map((e) => e.type)).toEqual(['accepted', 'scheduled', 'text-delta']);
    expect(h.finished).toEqual([{ finishReason: 'length', completionTokens: 1 }]);
    await live.close();
    await h.close();
  });

  it('stops the engine and writes nothing it made when the checks fail (a cancel marker), counting a skip; the answer ends abort', async () => {
    const h = await harness();
    const live = await listen('gw-skip');
    const j = job('gw-skip');
    await writeMeta(j);
    await redis.set(names.cancelMarkerKey(j.requestId), 'client_closed');
    const done = h.processor.process(j, 1);
    const signal = h.submitted[0]!.signal!;
    h.router.onEvents([[j.requestId, { type: 'text-delta', index: 0, tokenIds: [5], text: 'early' }]]);
    await waitFor('stopped', () => (signal.aborted ? true : undefined));
    expect(signal.reason).toBe('skipped');
    // The engine's finish after the abort settles the job.
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'abort' }],
      [j.requestId, finish(1)],
    ]);
    await done;
    await h.router.drained();
    // The canceller could not remove the job (this worker held it): the end it would have written
    // comes from here, so the stream ends now rather than at its queue timeout.
    const ending = [
      { requestId: j.requestId, seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 3 },
      { requestId: j.requestId, seq: 1, type: 'text-end', index: 0, finishReason: 'abort' },
      { requestId: j.requestId, seq: 2, type: 'finish', usage: { promptTokens: 3, completionTokens: 0 } },
    ];
    expect(await logOf(j.requestId)).toEqual(ending);
    await waitFor('live ending', () => (live.messages.length > 0 ? true : undefined));
    expect(live.messages.flat()).toEqual(ending);
    expect(h.finished).toEqual([]);
    expect(h.processor.counters).toMatchObject({ running: 0, skipped: 1, processed: 1 });
    await live.close();
    await h.close();
  });

  it('fails a continuation whose log lost its start (trimmed by its cap) instead of going on from part of it', async () => {
    const h = await harness();
    const live = await listen('gw-trimmed');
    const j = job('gw-trimmed', { continuation: { attempt: 2 } });
    await writeMeta(j, { attempt: '2' });
    // Entries 0–4 (the accepted with its seed, the first tokens) are gone.
    const kept = [5, 6].map((seq) => ({
      requestId: j.requestId,
      seq,
      type: 'text-delta',
      index: 0,
      text: 'x',
      tokenIds: [seq],
      tokens: 1,
    }));
    for (const entry of kept) await redis.xadd(names.logKey(j.requestId), `${entry.seq}-1`, LOG_FIELD, JSON.stringify(entry));
    await h.processor.process(j, 1);
    await h.router.drained();
    expect(h.submitted).toEqual([]);
    const failure = {
      requestId: j.requestId,
      seq: 7,
      type: 'error',
      error: {
        code: 'worker_lost',
        message: "The worker serving the request stopped, and the request's log no longer holds its start.",
        param: null,
      },
      attempt: 2,
    };
    expect((await logOf(j.requestId)).slice(kept.length)).toEqual([failure]);
    await waitFor('live failure', () => (live.messages.length > 0 ? true : undefined));
    expect(live.messages.flat()).toEqual([failure]);
    await live.close();
    await h.close();
  });

  it('ends a cancelled continuation after its log: the open choices abort, the usage counts what was sent', async () => {
    const h = await harness();
    const live = await listen('gw-skip-cont');
    const j = job('gw-skip-cont', { sampling: { maxTokens: 8, n: 2 }, continuation: { attempt: 2 } });
    await writeMeta(j, { attempt: '2' });
    const sent = [
      { requestId: j.requestId, seq: 0, type: 'accepted', workerId: 'w-lost', promptTokens: 3, seed: 7 },
      { requestId: j.requestId, seq: 1, type: 'text-delta', index: 0, text: 'a', tokenIds: [5], tokens: 1 },
      { requestId: j.requestId, seq: 2, type: 'text-delta', index: 1, text: 'b', tokenIds: [6], tokens: 1 },
      { requestId: j.requestId, seq: 3, type: 'text-end', index: 1, finishReason: 'stop' },
    ];
    await appendLog(j.requestId, sent);
    await redis.set(names.cancelMarkerKey(j.requestId), 'cancelled');
    await h.processor.process(j, 1);
    await h.router.drained();
    expect(h.submitted).toEqual([]);
    const ending = [
      { requestId: j.requestId, seq: 4, type: 'text-end', index: 0, finishReason: 'abort', attempt: 2 },
      { requestId: j.requestId, seq: 5, type: 'finish', usage: { promptTokens: 3, completionTokens: 2 }, attempt: 2 },
    ];
    expect((await logOf(j.requestId)).slice(sent.length)).toEqual(ending);
    await waitFor('live ending', () => (live.messages.length > 0 ? true : undefined));
    expect(live.messages.flat()).toEqual(ending);
    expect(h.processor.counters).toMatchObject({ running: 0, skipped: 1 });
    await live.close();
    await h.close();
  });

  it("stops a continuation's choices already submitted when the engine refuses a later one", async () => {
    const refusal = Object.assign(new Error('continuation.generatedTokenIds must be fewer than maxTokens.'), {
      name: 'EngineError',
      code: 'invalid_request',
    });
    const h = await harness(redis, (request) => (request.id.endsWith('#1') ? refusal : undefined));
    const j = job('gw-part-refused', { sampling: { maxTokens: 8, n: 2 }, continuation: { attempt: 2 } });
    const sent = await lostWorkersStart(j);
    await h.processor.process(j, 1);
    await h.router.drained();
    expect(h.submitted.map((s) => s.request.id)).toEqual([`${j.requestId}#0`]);
    expect(h.submitted[0]!.signal!.aborted).toBe(true);
    expect((await logOf(j.requestId)).slice(sent.length).map((e) => e.type)).toEqual(['rejected']);
    await h.close();
  });

  it('starts afresh a continuation of which nothing was logged (its worker was lost before it accepted): a whole request, an accepted that is not `continued`', async () => {
    const h = await harness();
    const live = await listen('gw-cont-empty');
    const j = job('gw-cont-empty', { sampling: { maxTokens: 8, n: 2 }, continuation: { attempt: 2 } });
    await writeMeta(j, { attempt: '2' });
    const done = h.processor.process(j, 1);
    await h.accepted(1);
    // One engine request with both choices, from the prompt: no per-choice continuation parts.
    expect(h.submitted.map((s) => [s.request.id, s.request.sampling.n, s.request.continuation])).toEqual([[j.requestId, 2, undefined]]);
    const seed = h.submitted[0]!.request.sampling.seed;
    expect(seed).toEqual(expect.any(Number));
    await h.step([
      [j.requestId, { type: 'text-delta', index: 0, tokenIds: [10], text: 'a' }],
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'length' }],
      [j.requestId, { type: 'text-end', index: 1, finishReason: 'length' }],
      [j.requestId, finish(1)],
    ]);
    await done;
    const log = await logOf(j.requestId);
    expect(log[0]).toEqual({ requestId: j.requestId, seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 3, seed, attempt: 2 });
    expect(log.map((e) => [e.seq, e.type])).toEqual([
      [0, 'accepted'],
      [1, 'text-delta'],
      [2, 'text-end'],
      [3, 'text-end'],
      [4, 'finish'],
    ]);
    await waitFor('live messages', () => (live.messages.flat().length === 5 ? true : undefined));
    await live.close();
    await h.close();
  });

  it('rejects a continuation of which nothing was logged that does not fit its context, as a first attempt', async () => {
    const h = await harness();
    const j = job('gw-cont-empty-long', { sampling: { maxTokens: 200 }, continuation: { attempt: 2 } });
    await writeMeta(j, { attempt: '2' });
    await h.processor.process(j, 1);
    await h.router.drained();
    expect(h.submitted).toEqual([]);
    expect(await logOf(j.requestId)).toMatchObject([
      { seq: 0, attempt: 2, type: 'rejected', error: { code: 'context_length_exceeded', param: 'max_tokens' } },
    ]);
    await h.close();
  });

  it('rejects a continuation that does not fit its context after the entries already in its log', async () => {
    const h = await harness();
    // The lost worker held a larger context: 200 completion tokens do not fit this one's 100.
    const j = job('gw-cont-too-long', { sampling: { maxTokens: 200 }, continuation: { attempt: 2 } });
    const sent = await lostWorkersStart(j);
    await h.processor.process(j, 1);
    await h.router.drained();
    expect(h.submitted).toEqual([]);
    expect((await logOf(j.requestId)).slice(sent.length)).toMatchObject([
      { seq: 2, attempt: 2, type: 'rejected', error: { code: 'context_length_exceeded', param: 'max_tokens' } },
    ]);
    await h.close();
  });

  it("answers an engine's refusal with a rejection naming the field, after the checks", async () => {
    const refusal = Object.assign(new Error('Request x: topP must be in (0, 1]'), { name: 'EngineError', code: 'invalid_request' });
    const h = await harness(redis, () => refusal);
    const j = job('gw-refused');
    await writeMeta(j);
    await h.processor.process(j, 1);
    await h.router.drained();
    expect((await logOf(j.requestId)).map((e) => (e.type === 'rejected' ? [e.type, e.error.param] : [e.type]))).toEqual([
      ['rejected', 'top_p'],
    ]);
    expect(h.processor.counters).toMatchObject({ running: 0, processed: 1 });
    await h.close();
  });

  it('stops the engine when the request was superseded while it waited (a newer attempt in its meta)', async () => {
    const h = await harness();
    const j = job('gw-sup');
    await writeMeta(j, { attempt: '2' });
    const done = h.processor.process(j, 1);
    const signal = h.submitted[0]!.signal!;
    await waitFor('stopped', () => (signal.aborted ? true : undefined));
    expect(signal.reason).toBe('skipped');
    await h.step([[j.requestId, finish(0)]]);
    await done;
    expect(await logOf(j.requestId)).toEqual([]);
    expect(h.processor.counters.skipped).toBe(1);
    await h.close();
  });
});

describe('the worker keeps each request route', () => {
  it("stops a request's old attempt before its continuation runs here (this worker was taken for dead), routing each attempt's events apart", async () => {
    const h = await harness();
    const live = await listen('gw-own');
    const j = job('gw-own');
    await writeMeta(j);
    const first = h.processor.process(j, 1);
    await h.accepted(1);
    await h.step([[j.requestId, { type: 'text-delta', index: 0, tokenIds: [5], text: 'a' }]]);
    // Taken for dead: a gateway moves the request to attempt 2, and its continuation comes back here
    // while attempt 1 still runs in the engine.
    await redis.hset(names.metaKey(j.requestId), 'attempt', '2');
    const second = h.processor.process({ ...j, continuation: { attempt: 2 } }, 1);
    const old = h.submitted[0]!.signal!;
    await waitFor('the old attempt stopped', () => (old.aborted ? true : undefined));
    expect(old.reason).toBe('superseded');
    expect(h.submitted).toHaveLength(1);
    // Its last events (a step that was under way) reach nobody; its finish lets the continuation start.
    await h.step([
      [j.requestId, { type: 'text-delta', index: 0, tokenIds: [6], text: 'b' }],
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'abort' }],
      [j.requestId, finish(2)],
    ]);
    await first;
    await waitFor('the continuation submitted', () => (h.submitted.length === 2 ? true : undefined));
    const part = h.submitted[1]!.request;
    expect(part.id).toBe(`${j.requestId}#0`);
    expect(part.continuation?.generatedTokenIds).toEqual([5]);
    await h.step([[part.id, { type: 'text-delta', index: 0, tokenIds: [7], text: 'c' }]]);
    await h.step([
      [part.id, { type: 'text-end', index: 0, finishReason: 'length' }],
      [part.id, finish(1)],
    ]);
    await second;
    await h.router.drained();
    const log = await logOf(j.requestId);
    expect(log.map((e) => [e.seq, e.type, e.type === 'text-delta' ? e.text : '', e.attempt ?? 1])).toEqual([
      [0, 'accepted', '', 1],
      [1, 'text-delta', 'a', 1],
      [2, 'accepted', '', 2],
      [3, 'text-delta', 'c', 2],
      [4, 'text-end', '', 2],
      [5, 'finish', '', 2],
    ]);
    expect(h.processor.counters.running).toBe(0);
    await live.close();
    await h.close();
  });

  it('keeps a route message that came while its checks were out over the older meta they read (a resume on another gateway)', async () => {
    const h = await harness();
    const live = await listen('gw-resumed');
    const j = job('gw-left', { resumeGraceMs: 60_000 });
    // The meta the checks read: detached (the first client left within its grace)...
    await writeMeta(j, { channel: '', detachedAt: String(Date.now()) });
    const done = h.processor.process(j, 1);
    // ...and, before their reply is handled, the attach of a resume elsewhere reaches the worker.
    h.router.attach(j.requestId, 'gw-resumed');
    await h.accepted(1);
    await h.step([[j.requestId, { type: 'text-delta', index: 0, tokenIds: [5], text: 'a' }]]);
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'length' }],
      [j.requestId, finish(1)],
    ]);
    await done;
    await waitFor('the entries live at the resuming gateway', () =>
      live.messages.flat().some((e) => e.type === 'finish') ? true : undefined,
    );
    expect(live.messages.flat().map((e) => e.type)).toEqual(['accepted', 'text-delta', 'text-end', 'finish']);
    await live.close();
    await h.close();
  });

  it('skips a second delivery of an attempt it runs already (a BullMQ stalled-job retry)', async () => {
    const h = await harness();
    const j = job('gw-twice');
    await writeMeta(j);
    const first = h.processor.process(j, 1);
    await h.accepted(1);
    await h.processor.process(j, 2);
    expect(h.processor.counters.skipped).toBe(1);
    expect(h.submitted).toHaveLength(1);
    await h.step([[j.requestId, { type: 'text-delta', index: 0, tokenIds: [5], text: 'a' }]]);
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'length' }],
      [j.requestId, finish(1)],
    ]);
    await first;
    await h.router.drained();
    expect((await logOf(j.requestId)).map((e) => [e.seq, e.type])).toEqual([
      [0, 'accepted'],
      [1, 'text-delta'],
      [2, 'text-end'],
      [3, 'finish'],
    ]);
    await h.close();
  });

  it('stops a request fenced out by a newer attempt', async () => {
    const h = await harness();
    const live = await listen('gw-f');
    const j = job('gw-f');
    await writeMeta(j);
    const done = h.processor.process(j, 1);
    await h.accepted(1);
    await redis.hset(names.metaKey(j.requestId), 'attempt', '2');
    await h.step([[j.requestId, { type: 'text-delta', index: 0, tokenIds: [1], text: 'x' }]]);
    const signal = h.submitted[0]!.signal!;
    await waitFor('aborted', () => (signal.aborted ? true : undefined));
    expect(signal.reason).toBe('superseded');
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'abort' }],
      [j.requestId, finish(1)],
    ]);
    await done;
    // Only what the request's own attempt wrote before the fence is in its log.
    expect((await logOf(j.requestId)).map((e) => e.type)).toEqual(['accepted']);
    await live.close();
    await h.close();
  });

  it('cancels the requests of a gateway that is gone (no subscriber, no alive key) when they have no grace', async () => {
    const h = await harness();
    const j = job('gw-dead');
    const done = h.processor.process(j, 1);
    await h.accepted(1);
    const signal = h.submitted[0]!.signal!;
    await waitFor('cancelled', () => (signal.aborted ? true : undefined));
    expect(signal.reason).toBe('client_closed');
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'abort' }],
      [j.requestId, finish(0)],
    ]);
    await done;
    expect((await logOf(j.requestId)).map((e) => e.type)).toEqual(['accepted', 'text-end', 'finish']);
    await h.close();
  });

  it("goes by the meta's route, not by the order route messages arrive in, and by it takes a gateway's cancel or not", async () => {
    const h = await harness();
    await h.controls.start();
    const live = await listen('gw-c');
    const j = job('gw-a');
    await writeMeta(j);
    const run = h.processor.process(j, 1);
    await h.accepted(1);
    const signal = h.submitted[0]!.signal!;
    // Resumed on B, then on C; B's route message arrives last (B was slow).
    await redis.hset(names.metaKey(j.requestId), 'channel', 'gw-c');
    await redis.publish(names.controlChannel, encodeControlMessage({ type: 'route', requestId: j.requestId, channel: 'gw-c' }));
    await redis.publish(names.controlChannel, encodeControlMessage({ type: 'route', requestId: j.requestId, channel: 'gw-b' }));
    await waitFor('the route read again', () => (h.router.channelOf(j.requestId) === 'gw-c' ? true : undefined));
    await new Promise((resolve) => setTimeout(resolve, 100));
    expect(h.router.channelOf(j.requestId)).toBe('gw-c');
    // B's client leaves: its cancel must not stop the work C's client reads, whatever this worker's view.
    h.router.attach(j.requestId, 'gw-b');
    await redis.publish(
      names.controlChannel,
      encodeControlMessage({ type: 'cancel', requestIds: [j.requestId], reason: 'client_closed', channel: 'gw-b' }),
    );
    await new Promise((resolve) => setTimeout(resolve, 200));
    expect(signal.aborted).toBe(false);
    // C's client leaves: that cancel applies.
    await redis.publish(
      names.controlChannel,
      encodeControlMessage({ type: 'cancel', requestIds: [j.requestId], reason: 'client_closed', channel: 'gw-c' }),
    );
    await waitFor('cancelled', () => (signal.aborted ? true : undefined));
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'abort' }],
      [j.requestId, finish(0)],
    ]);
    await run;
    await live.close();
    await h.close();
  });

  it('keeps a detached request running for its grace, and a client that attaches keeps it', async () => {
    const h = await harness();
    const live = await listen('gw-g');
    const j = job('gw-g', { resumeGraceMs: 300 });
    const k = job('gw-g', { resumeGraceMs: 300 });
    const runs = [h.processor.process(j, 1), h.processor.process(k, 1)];
    await h.accepted(2);
    const [sj, sk] = h.submitted.map((s) => s.signal!);
    h.router.detach(j.requestId, 'gw-g');
    h.router.detach(k.requestId, 'gw-g');
    h.router.attach(k.requestId, 'gw-other');
    await waitFor('grace over', () => (sj!.aborted ? true : undefined), 5_000);
    expect(sj!.reason).toBe('client_closed');
    expect(sk!.aborted).toBe(false);
    expect(h.router.channelOf(k.requestId)).toBe('gw-other');
    await h.step([
      [j.requestId, { type: 'text-end', index: 0, finishReason: 'abort' }],
      [j.requestId, finish(0)],
      [k.requestId, { type: 'text-end', index: 0, finishReason: 'stop' }],
      [k.requestId, finish(0)],
    ]);
    await Promise.all(runs);
    await live.close();
    await h.close();
  });
});
