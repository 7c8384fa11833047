import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { generateTinyModel } from '@sluice/model';
import { Cluster, FAKE_ENGINE, MODEL } from './support/cluster.js';
import { freezeMidAnswers, retryMidAnswer, unfinishedInLog } from './support/mid-answer.js';
import { sleep, waitFor } from './support/processes.js';
import { readSse } from './support/sse.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * Exact continuation when a worker dies, from outside: real redis-server, gateway and workers (the
 * tiny model), the official `openai` client. A stream whose worker is SIGKILLed (or frozen past its
 * registry TTL) pauses and goes on, on another worker, with exactly the text, token choices and
 * finish reasons of an uninterrupted run.
 */

const WORKER_ENV = {
  WORKER_HEARTBEAT_MS: '250',
  WORKER_TTL_MS: '1500',
  LOCK_DURATION_MS: '30000',
  MAX_BATCH_SIZE: '64',
  LOG_LEVEL: 'info',
};
// Streams wait while workers start after a kill (seconds each under a loaded CI machine, twice in one
// test): the idle timeout, not what these tests check, must not end them first.
const GATEWAY_ENV = { REGISTRY_POLL_MS: '200', LOG_LEVEL: 'info', IDLE_TIMEOUT_MS: '120000' };

type Params = OpenAI.ChatCompletionCreateParamsStreaming;

/** 64 requests: greedy and seeded sampling, n = 2, logprobs, stop strings. */
function mix(count: number, maxTokens: number): Params[] {
  return Array.from({ length: count }, (_, i) => {
    const params: Params = {
      model: MODEL,
      messages: [{ role: 'user', content: `Story ${i}: tell me about the ${['sea', 'fox', 'rain', 'city'][i % 4]}.` }],
      max_tokens: maxTokens,
      stream: true,
      ...({ ignore_eos: true } as object),
    };
    if (i % 2 === 0) params.temperature = 0;
    else Object.assign(params, { temperature: 1, top_p: 0.9, seed: 1000 + i });
    if (i % 4 === 1) params.n = 2;
    if (i % 8 === 3) Object.assign(params, { logprobs: true, top_logprobs: 2 });
    if (i % 8 === 5) params.stop = ['e t', 'qz'];
    return params;
  });
}

interface Choice {
  text: string;
  finish: string | null;
  tokens: string[];
  logprobs: number[];
}

interface Result {
  choices: Choice[];
  /** Arrival time of every content chunk (ms since epoch). */
  times: number[];
  error: unknown;
}

/** Runs a request with the official client; `onChunk` gets each chunk's id, `signal` makes the client leave. */
async function run(client: OpenAI, params: Params, onChunk?: (id: string) => void, signal?: AbortSignal): Promise<Result> {
  const result: Result = { choices: [], times: [], error: undefined };
  try {
    const stream = await client.chat.completions.create(params, { signal });
    for await (const chunk of stream) {
      // Any chunk (the role chunk first) says the request is under way on a worker.
      onChunk?.(chunk.id);
      for (const c of chunk.choices) {
        const choice = (result.choices[c.index] ??= { text: '', finish: null, tokens: [], logprobs: [] });
        if (c.delta.content) {
          choice.text += c.delta.content;
          result.times.push(Date.now());
        }
        for (const lp of c.logprobs?.content ?? []) {
          choice.tokens.push(lp.token);
          choice.logprobs.push(lp.logprob);
        }
        choice.finish = c.finish_reason ?? choice.finish;
      }
    }
  } catch (error) {
    result.error = error;
  }
  return result;
}

/**
 * Same text, finish reasons and sampled tokens, and (`exact`) the same logprobs to the last bit: the
 * plain form's numbers do not depend on the batch beside a row (docs/engine.md, "Batch invariance";
 * stop 59), and the workers share their settings, so a continuation replays the original run's
 * arithmetic. The GQA operator's case keeps a 1e-4 tolerance: its logprobs were bit for bit on the
 * Intel hosts, but on an AMD EPYC host one run in about ten differed by 3e-6 (request 43: -0.8938506 vs
 * -0.8938477; the batch beside a row differs between the reference run and the faulted one), not traced.
 */
function expectSameAnswer(got: Result, want: Result, where: string, exact: boolean): void {
  expect(got.error, where).toBeUndefined();
  expect(
    got.choices.map((c) => [c.text, c.finish, c.tokens]),
    where,
  ).toEqual(want.choices.map((c) => [c.text, c.finish, c.tokens]));
  got.choices.forEach((c, i) =>
    exact
      ? expect(c.logprobs, where).toEqual(want.choices[i]!.logprobs)
      : c.logprobs.forEach((lp, j) => expect(Math.abs(lp - want.choices[i]!.logprobs[j]!), where).toBeLessThan(1e-4)),
  );
}

/** A request running in the background, and a way to leave it like a client. */
interface Running {
  /** The gateway's job id (keys its token log), from its chunks' `chatcmpl-{id}`; '' until the first chunk. */
  readonly jobId: string;
  readonly result: Promise<Result>;
  abort(): void;
}

function startRun(client: OpenAI, params: Params): Running {
  const controller = new AbortController();
  let jobId = '';
  const result = run(client, params, (id) => (jobId ||= id.replace(/^chatcmpl-/, '')), controller.signal);
  return {
    get jobId() {
      return jobId;
    },
    result,
    abort: () => controller.abort(),
  };
}

/** A token log's answer is unfinished (no end entry), however many tokens it holds (see mid-answer.ts). */
const ANY_LENGTH = Number.POSITIVE_INFINITY;

function percentile(values: number[], p: number): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))] ?? NaN;
}

describe.each(FAKE_ENGINE ? (['plain'] as const) : (['plain', 'gqa'] as const))(
  'exact continuation when a worker dies (%s attention)',
  (form) => {
    let cluster: Cluster;
    let gateway: GatewayProcess;
    let client: OpenAI;
    let workerEnv: Record<string, string> = WORKER_ENV;
    let removeModel = async (): Promise<void> => {};
    /** Logprobs held to the last bit (see {@link expectSameAnswer}). */
    const exact = form === 'plain';

    beforeAll(async () => {
      if (form === 'gqa') {
        // The same tiny model's weights and tokenizer, written with GroupQueryAttention, run by the
        // operator (the default decomposes it into the plain form's ops, which the plain case covers).
        const dir = await mkdtemp(join(tmpdir(), 'sluice-tiny-gqa-'));
        await generateTinyModel({ preset: 'tiny', outDir: dir, attention: 'gqa' });
        workerEnv = { ...WORKER_ENV, MODEL_DIR: dir, MODEL_ID: MODEL, GQA_ATTENTION: 'op' };
        removeModel = () => rm(dir, { recursive: true, force: true });
      }
      cluster = await Cluster.start();
      await Promise.all([cluster.worker(workerEnv), cluster.worker(workerEnv)]);
      gateway = await cluster.gateway(GATEWAY_ENV);
      client = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
    }, 180_000);

    afterAll(async () => {
      await cluster?.stop();
      await removeModel();
    });

    /** Starts workers until `count` are alive (a test before may have killed some). */
    async function ensureWorkers(count: number): Promise<void> {
      const alive = cluster.workers.filter((w) => w.process.child.exitCode === null && w.process.child.signalCode === null);
      await Promise.all(Array.from({ length: Math.max(0, count - alive.length) }, () => cluster.worker(workerEnv)));
    }

    /** The live workers that run some of the requests, the busiest first (the one a fault hits hardest). */
    async function busyWorkers(): Promise<WorkerProcess[]> {
      const live = cluster.workers.filter((w) => w.process.child.exitCode === null && w.process.child.signalCode === null);
      const running = (await Promise.all(live.map((w) => w.health().catch(() => undefined)))).map((h) => h?.running ?? 0);
      return live
        .map((w, i) => ({ w, running: running[i]! }))
        .filter((x) => x.running > 0)
        .sort((a, b) => b.running - a.running)
        .map((x) => x.w);
    }

    const alive = (w: WorkerProcess) => w.process.child.exitCode === null && w.process.child.signalCode === null;

    /**
     * Starts `requests` and, once every one is under way, freezes the workers `pick` names (SIGSTOP) with
     * each stream `watch` selects unfinished in its token log, with at most half of its `maxTokens` (see
     * mid-answer.ts), whatever the machine's speed; else thaws them, lets the streams go (aborted, and
     * gone from the workers) and starts them again (5 tries). Returns them with those workers frozen.
     */
    async function startFrozen(
      requests: Params[],
      maxTokens: number,
      pick: () => Promise<WorkerProcess[]>,
      watch: (params: Params) => boolean = () => true,
    ): Promise<{ runs: Running[]; frozen: WorkerProcess[] }> {
      const redis = cluster.redis.client();
      try {
        return await retryMidAnswer('a stream', async () => {
          const runs = requests.map((params) => startRun(client, params));
          await waitFor('every stream under way', () => (runs.every((r) => r.jobId !== '') ? true : undefined), 60_000);
          const frozen = await pick();
          const watched = runs.filter((_, i) => watch(requests[i]!));
          if ((await freezeMidAnswers(frozen, redis, watched, maxTokens)) !== null) return { runs, frozen };
          for (const r of runs) r.abort();
          await Promise.all(runs.map((r) => r.result));
          // (Only the picked workers ran them; another may be frozen by the caller.)
          await waitFor('the streams let go gone from the workers', async () => {
            const running = await Promise.all(frozen.filter(alive).map(async (w) => (await w.health()).running));
            return running.every((n) => n === 0) ? true : undefined;
          });
          return undefined;
        });
      } finally {
        redis.disconnect();
      }
    }

    /**
     * A worker whose drain bound is 0 holding every one of `requests`, frozen with each stream without
     * stop strings mid-answer; the other workers are frozen too, so that it takes them all (the caller
     * thaws `others` and the drainer; on a failure this does).
     */
    async function drainerWithStreams(requests: Params[]): Promise<{ drainer: WorkerProcess; others: WorkerProcess[]; runs: Running[] }> {
      const others = cluster.workers.filter(alive);
      const drainer = await cluster.worker({ ...workerEnv, DRAIN_TIMEOUT_MS: '0' });
      for (const w of others) w.process.child.kill('SIGSTOP');
      try {
        const { runs } = await startFrozen(
          requests,
          1000,
          async () => [drainer],
          (params) => params.stop === undefined,
        );
        return { drainer, others, runs };
      } catch (error) {
        for (const w of [...others, drainer]) w.process.child.kill('SIGCONT');
        throw error;
      }
    }

    /**
     * Starts `requests`, freezes the busy workers once every stream has text and every one without stop
     * strings is unfinished in its log (see startFrozen: the fault lands mid-stream on any machine),
     * applies `fault`, and collects everything.
     */
    async function withFault(
      requests: Params[],
      fault: (workers: WorkerProcess[]) => Promise<number>,
    ): Promise<{ results: Result[]; faultAt: number }> {
      await ensureWorkers(2);
      // BullMQ may have given every job to one worker: the busiest is the victim, and any other worker
      // (busy or idle) carries on. However far a stream got: what the victim's engine ran past its log
      // dies with it (SIGKILL) or is fenced out (a worker that only looked dead).
      const { runs, frozen } = await startFrozen(requests, ANY_LENGTH, busyWorkers, (params) => params.stop === undefined);
      expect(frozen.length).toBeGreaterThanOrEqual(1);
      const faultAt = await fault(frozen);
      return { results: await Promise.all(runs.map((r) => r.result)), faultAt };
    }

    it('continues 64 streams of a SIGKILLed worker on the other, token-identical (greedy, seeded, n = 2, logprobs, stop)', async () => {
      const requests = mix(64, 500);
      const reference = await Promise.all(requests.map((params) => run(client, params)));
      const { results, faultAt } = await withFault(requests, async ([victim, survivor]) => {
        victim!.process.child.kill('SIGKILL');
        const at = Date.now();
        survivor?.process.child.kill('SIGCONT');
        return at;
      });
      if (results.some((r) => r.error !== undefined))
        console.log(
          cluster
            .logs()
            .split('\n')
            .filter((l) => /warn|error|migrat|continu|skipped|lost/i.test(l))
            .slice(0, 40)
            .join('\n'),
        );
      results.forEach((r, i) => expectSameAnswer(r, reference[i]!, `request ${i}`, exact));
      // The pause the client saw: the longest wait between two content chunks after the kill. (The first
      // chunk after the kill may have been sent before it: the client reads buffered chunks late.)
      const pauses = results.map((r) => {
        let longest = 0;
        for (let i = 1; i < r.times.length; i++) if (r.times[i]! > faultAt) longest = Math.max(longest, r.times[i]! - r.times[i - 1]!);
        return longest;
      });
      const migrated = pauses.filter((ms) => ms >= 1_000);
      console.log(
        `pause after SIGKILL: ${migrated.length} migrated streams p50 ${percentile(migrated, 50)} ms, max ${Math.max(...migrated)} ms; ` +
          `${pauses.length - migrated.length} others p50 ${percentile(
            pauses.filter((ms) => ms < 1_000),
            50,
          )} ms (${form} attention, worker TTL 1500 ms, registry poll 200 ms)`,
      );
      // The freeze comes as soon as every request is accepted, so most of the victim's streams (half or
      // more of the 64) are mid-way; a few on a very fast machine is still a migration of each.
      expect(migrated.length, 'streams of the killed worker moved mid-way').toBeGreaterThanOrEqual(4);
      const metrics = await (await fetch(`${gateway.url}/metrics`)).text();
      expect(metrics).toMatch(/sluice_gateway_stream_migrations_total [1-9]/);
    }, 300_000);

    it.runIf(form === 'plain')(
      'continues on a fresh worker that starts after the kill, and again when that one is killed too',
      async () => {
        await ensureWorkers(2);
        const maxTokens = 1000;
        const requests = mix(16, maxTokens);
        const reference = await Promise.all(requests.map((params) => run(client, params)));
        // Every worker dies, busy or not, with every stream mid-answer (one with stop strings may end
        // early on its own).
        const noStop = (params: Params) => params.stop === undefined;
        const { runs, frozen: all } = await startFrozen(requests, maxTokens, async () => cluster.workers.filter(alive), noStop);
        for (const w of all) w.process.child.kill('SIGKILL');
        // Nobody is left: the streams wait (migrated into the queue) until a fresh worker starts.
        await sleep(2_000);
        const fresh = await cluster.worker(workerEnv);
        await waitFor(
          'the fresh worker took the continuations',
          async () => ((await fresh.health()).running > 0 ? true : undefined),
          30_000,
        );
        // Killed in turn with those streams still unfinished in their logs, whatever the machine's speed.
        const redis = cluster.redis.client();
        try {
          const watched = runs.filter((_, i) => noStop(requests[i]!));
          expect(await freezeMidAnswers([fresh], redis, watched, ANY_LENGTH), 'the streams unfinished on the fresh worker').not.toBeNull();
        } finally {
          redis.disconnect();
        }
        const another = await cluster.worker(workerEnv);
        fresh.process.child.kill('SIGKILL');
        const results = await Promise.all(runs.map((r) => r.result));
        results.forEach((r, i) => expectSameAnswer(r, reference[i]!, `request ${i}`, exact));
        expect((await another.health()).processed).toBeGreaterThan(0);
      },
      300_000,
    );

    it.runIf(form === 'plain')(
      'continues token-identical when the only worker, taken for dead (frozen past its TTL), gets its own requests back',
      async () => {
        // Its job locks expire while it is frozen too: BullMQ hands the first attempts out again (stalled).
        const others = cluster.workers.filter(alive);
        const solo = await cluster.worker({ ...workerEnv, LOCK_DURATION_MS: '3000' });
        const maxTokens = 1000;
        const requests = mix(8, maxTokens);
        // The others frozen throughout: the continuations can only go back to the worker that still
        // runs the old attempts (it used to route the old attempt's events into the new one's route:
        // text repeated or cut, a hung stream, a `running` count that never fell).
        for (const w of others) w.process.child.kill('SIGSTOP');
        const redis = cluster.redis.client();
        try {
          const reference = await Promise.all(requests.map((params) => run(client, params)));
          const noStop = (params: Params) => params.stop === undefined;
          const { runs } = await startFrozen(requests, maxTokens, async () => [solo], noStop);
          const frozenAt = Date.now();
          // Past its registry TTL the gateway moves its requests to attempt 2 (continuations queued).
          await waitFor(
            'the frozen worker taken for dead',
            async () => {
              const attempts = await Promise.all(runs.map((r) => redis.hget(`sluice:{${r.jobId}}:meta`, 'attempt')));
              return runs.every((r, i) => !noStop(requests[i]!) || Number(attempts[i]) >= 2) ? true : undefined;
            },
            30_000,
          );
          await sleep(Math.max(0, frozenAt + 4_000 - Date.now()));
          solo.process.child.kill('SIGCONT');
          const results = await Promise.all(runs.map((r) => r.result));
          results.forEach((r, i) => expectSameAnswer(r, reference[i]!, `request ${i}`, exact));
          await waitFor('the worker idle again', async () => ((await solo.health()).running === 0 ? true : undefined), 10_000);
          expect(cluster.logs()).not.toMatch(/equal or smaller than the target stream top item/);
        } finally {
          solo.process.child.kill('SIGCONT');
          for (const w of others) w.process.child.kill('SIGCONT');
          redis.disconnect();
        }
      },
      300_000,
    );

    it.runIf(form === 'plain')(
      'hands the streams of a draining worker (SIGTERM, drain bound reached) to another worker, token-identical',
      async () => {
        await ensureWorkers(2);
        const requests = mix(16, 1000);
        const reference = await Promise.all(requests.map((params) => run(client, params)));
        // Every stream on one worker whose drain bound is 0, frozen mid-stream, told to stop, then let
        // go: it drains at once and hands every request over.
        const { drainer, others, runs } = await drainerWithStreams(requests);
        try {
          drainer.process.child.kill('SIGTERM');
        } finally {
          for (const w of others) w.process.child.kill('SIGCONT');
          drainer.process.child.kill('SIGCONT');
        }
        const results = await Promise.all(runs.map((r) => r.result));
        results.forEach((r, i) => expectSameAnswer(r, reference[i]!, `request ${i}`, exact));
        expect(await drainer.process.exited).toEqual({ code: 0, signal: null });
        expect(cluster.logs()).toMatch(/handed over to another worker/);
      },
      300_000,
    );

    it.runIf(form === 'plain')(
      'under writes Redis refuses (out of memory) as a drain ends: never a duplicated or altered text, every stream ends',
      async () => {
        await ensureWorkers(2);
        const requests = mix(4, 1000);
        const reference = await Promise.all(requests.map((params) => run(client, params)));
        const { drainer, others, runs } = await drainerWithStreams(requests);
        const redis = cluster.redis.client();
        try {
          // Redis refuses every write (maxmemory reached) as the drain ends: the last steps' appends are
          // refused while their publishes reach the gateway, and the handover's move is refused.
          await redis.config('SET', 'maxmemory', '1');
          drainer.process.child.kill('SIGTERM');
          drainer.process.child.kill('SIGCONT');
          await waitFor('a refused write', () => (drainer.process.output().includes('OOM') ? true : undefined));
        } finally {
          await redis.config('SET', 'maxmemory', '0');
          redis.disconnect();
          for (const w of others) w.process.child.kill('SIGCONT');
          drainer.process.child.kill('SIGCONT');
        }
        const results = await Promise.all(runs.map((r) => r.result));
        results.forEach((r, i) => {
          const want = reference[i]!;
          // The whole answer (handed over: the log held every entry its client had), or an honest end
          // (worker_shutdown: the log lacks entries the client has, so no continuation lines up; a
          // continuation that ran from such a log used to duplicate text), never a text the reference lacks.
          if (r.error === undefined) expectSameAnswer(r, want, `request ${i}`, exact);
          else
            r.choices.forEach((c, k) => expect(want.choices[k]!.text.startsWith(c.text), `request ${i} choice ${k}: ${c.text}`).toBe(true));
        });
        expect(await drainer.process.exited).toEqual({ code: 0, signal: null });
      },
      300_000,
    );

    for (const fault of ['SIGKILL', 'SIGTERM'] as const) {
      it.runIf(form === 'plain')(
        fault === 'SIGKILL'
          ? 'moves a detached request (its client left within its resume grace) off a dead worker: a later resume gets the whole rest'
          : 'hands a detached request over when its worker drains (SIGTERM, drain bound 0): a later resume gets the whole rest',
        async () => {
          await ensureWorkers(2);
          // The SIGTERM case needs a worker with no drain time holding the request: only it runs while the others are frozen.
          const others = cluster.workers.filter((w) => w.process.child.exitCode === null && w.process.child.signalCode === null);
          const drainer = fault === 'SIGTERM' ? await cluster.worker({ ...workerEnv, DRAIN_TIMEOUT_MS: '0' }) : undefined;
          const maxTokens = 1200;
          const params = { ...mix(1, maxTokens)[0]!, temperature: 0 } as Params;
          const reference = await run(client, params);
          if (drainer !== undefined) for (const w of others) w.process.child.kill('SIGSTOP');
          const workers = cluster.workers.filter(alive);
          // The workers that may run it: every one, or only the draining one (the others are frozen).
          const running = drainer === undefined ? workers : [drainer];
          let id = '';
          let lastEventId = '';
          let before = '';
          const redis = cluster.redis.client();
          try {
            // Mid-answer on any machine: the workers frozen with its answer unfinished in its token log (see
            // mid-answer.ts), then the client leaves; else it runs on (detached, to its end) and another tries.
            for (let attempt = 1; ; attempt++) {
              if (attempt > 5) throw new Error('in each of 5 tries the stream ended before the workers could be frozen mid-answer');
              const res = await fetch(`${gateway.url}/v1/chat/completions`, {
                method: 'POST',
                headers: { 'Content-Type': 'application/json' },
                body: JSON.stringify({ ...params, resume_grace_ms: 60_000 }),
              });
              id = '';
              lastEventId = '';
              before = '';
              let frozen = false;
              for await (const item of readSse(res.body!)) {
                if (item.kind !== 'data' || item.data === '[DONE]') continue;
                const chunk = JSON.parse(item.data) as { id: string; choices: Array<{ delta: { content?: string } }> };
                id = chunk.id;
                lastEventId = item.id ?? lastEventId;
                before += chunk.choices[0]?.delta.content ?? '';
                if (before.length > 20) {
                  const jobId = id.slice('chatcmpl-'.length);
                  frozen = (await freezeMidAnswers(running, redis, [{ jobId }], maxTokens)) !== null;
                  break;
                }
              }
              await res.body?.cancel().catch(() => undefined);
              if (frozen) break;
              const dropped = id.slice('chatcmpl-'.length);
              await waitFor('the dropped request ended', async () =>
                (await unfinishedInLog(redis, dropped, ANY_LENGTH)) ? undefined : true,
              );
            }
            const jobId = id.slice('chatcmpl-'.length);
            const meta = `sluice:{${jobId}}:meta`;
            await waitFor('the request detached', async () => ((await redis.hget(meta, 'channel')) === '' ? true : undefined));
            const workerId = await redis.hget(meta, 'workerId');
            const holder = workers.find((w) => w.process.child.pid !== undefined && workerId?.includes(String(w.process.child.pid)));
            expect(holder, `the worker running ${jobId} (${workerId})`).toBeDefined();
            if (drainer !== undefined) expect(holder).toBe(drainer);
            holder!.process.child.kill(fault);
            for (const w of workers) w.process.child.kill('SIGCONT');
            // No gateway holds its stream: the draining worker, or a gateway that sees the worker gone, moves it, detached.
            await waitFor(
              'the detached request moved',
              async () => ((await redis.hget(meta, 'attempt')) === '2' ? true : undefined),
              30_000,
            );
            expect(await redis.hget(meta, 'channel')).toBe('');
          } finally {
            redis.disconnect();
          }
          // The client comes back: the rest, from its cursor, equals the uninterrupted answer's.
          const resumed = await fetch(`${gateway.url}/v1/chat/completions/${id}?stream=true`, {
            headers: { 'Last-Event-ID': lastEventId },
          });
          expect(resumed.status).toBe(200);
          let after = '';
          for await (const item of readSse(resumed.body!)) {
            if (item.kind !== 'data' || item.data === '[DONE]') continue;
            const chunk = JSON.parse(item.data) as { error?: unknown; choices?: Array<{ delta: { content?: string } }> };
            expect(chunk.error, JSON.stringify(chunk.error)).toBeUndefined();
            after += chunk.choices?.[0]?.delta.content ?? '';
          }
          expect(before + after).toBe(reference.choices[0]!.text);
          if (drainer !== undefined) expect(await drainer.process.exited).toEqual({ code: 0, signal: null });
        },
        300_000,
      );
    }

    it.runIf(form === 'plain')(
      'fences out a worker that only looked dead (SIGSTOP past its TTL, then SIGCONT): no duplicated, missing or reordered token',
      async () => {
        const requests = mix(16, 800);
        const reference = await Promise.all(requests.map((params) => run(client, params)));
        let frozen: WorkerProcess | undefined;
        const { results } = await withFault(requests, async ([victim, survivor]) => {
          frozen = victim;
          survivor?.process.child.kill('SIGCONT');
          const at = Date.now();
          // Past its 1.5 s TTL: its streams move to the survivor, then it wakes up mid-step.
          await sleep(3_500);
          victim!.process.child.kill('SIGCONT');
          return at;
        });
        results.forEach((r, i) => expectSameAnswer(r, reference[i]!, `request ${i}`, exact));
        // The woken worker dropped the sequences it lost at its next step.
        await waitFor(
          'the stale worker stopped its sequences',
          async () => ((await frozen!.health()).running === 0 ? true : undefined),
          10_000,
        );
      },
    );

    it.runIf(form === 'plain')(
      'ends a stream with an explicit error frame when its log is gone (Redis lost its data), without hanging',
      async () => {
        const maxTokens = 1500;
        const requests = mix(4, maxTokens).map((p) => ({ ...p, n: 1 }));
        // The log goes with every stream mid-answer, whatever the machine's speed.
        const { runs, frozen: busy } = await startFrozen(requests, maxTokens, busyWorkers);
        const redis = cluster.redis.client();
        await redis.flushall();
        redis.disconnect();
        for (const w of busy) w.process.child.kill('SIGKILL');
        const results = await Promise.all(runs.map((r) => r.result));
        for (const r of results) {
          expect(r.error).toBeDefined();
          expect(String((r.error as Error).message)).toMatch(/stopped/);
        }
      },
    );
  },
);
