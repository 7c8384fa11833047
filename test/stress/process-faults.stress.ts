import { describe, expect, it } from 'vitest';
import {
  afterTextChunks,
  chatBody,
  MIGRATING_GATEWAY_ENV,
  MIGRATING_WORKER_ENV,
  notWhole,
  post,
  readReply,
  resume,
  ROUNDS,
  twoWorkersTwoGateways,
  whenAllReach,
} from './stress-support.js';

/**
 * Process faults mid-stream, looped (`npm run stress`; not in the default suite): two workers and two
 * gateways (tiny model), four long greedy streams a case. Each round SIGKILLs a worker (its streams
 * migrate), kills every pub/sub connection in Redis, SIGKILLs a gateway (its clients resume on the
 * other, mid-stream or while its requests wait), freezes a worker past its registry TTL and thaws it
 * (fenced out), freezes Redis past the workers' TTL (no loss), and again while a worker is SIGKILLed
 * (its streams migrate once Redis serves), drains a worker (SIGTERM: handed over), and SIGKILLs the
 * worker of clients that left within their grace (they resume elsewhere); every answer must arrive
 * whole, token for token.
 */
const WORKER_ENV = { ...MIGRATING_WORKER_ENV, MAX_BATCH_SIZE: '64' };
const MAX_TOKENS = 1_500;
const PROMPTS = ['alpha', 'beta', 'gamma', 'delta'];

describe('process faults mid-stream, looped', () => {
  const stack = twoWorkersTwoGateways(WORKER_ENV);

  it(`delivers every answer whole, ${ROUNDS} rounds`, async () => {
    const { cluster, workers, gateways } = stack;
    const redis = cluster.redis.client();
    const failures: string[] = [];
    const answers = new Map<string, string>();
    for (const prompt of PROMPTS) answers.set(prompt, (await readReply(post(gateways[0]!, chatBody(prompt, MAX_TOKENS)).reply)).text);

    /** Four streams over both gateways; `fault` runs once each had `k` text chunks; all must be whole. */
    const streamsThrough = async (what: string, k: number, fault: () => Promise<void>) => {
      const progress = whenAllReach(PROMPTS.length, k);
      const runs = PROMPTS.map((prompt, i) => readReply(post(gateways[i % 2]!, chatBody(prompt, MAX_TOKENS)).reply, progress.until));
      await progress.reached;
      await fault();
      (await Promise.all(runs)).forEach((got, i) => {
        const why = notWhole(got, answers.get(PROMPTS[i]!)!);
        if (why !== undefined) failures.push(`${what} (${PROMPTS[i]}): ${why}`);
      });
    };

    for (let round = 0; round < ROUNDS; round++) {
      await streamsThrough(`worker SIGKILLed, round ${round}`, 5 + round, async () => {
        workers.shift()!.process.child.kill('SIGKILL');
      });
      workers.push(await cluster.worker(WORKER_ENV));

      await streamsThrough(`pub/sub connections killed, round ${round}`, 3 + round, async () => {
        await redis.call('CLIENT', 'KILL', 'TYPE', 'pubsub');
      });

      await streamsThrough(`worker frozen past its TTL, round ${round}`, 5 + round, async () => {
        workers[0]!.process.signal('SIGSTOP');
        await new Promise((resolve) => setTimeout(resolve, 3_000));
        workers[0]!.process.signal('SIGCONT');
      });

      // Redis itself stalls (a slow command, a fork, a paused VM) past the workers' TTL: no worker is
      // lost; and a worker killed during such a stall is, once Redis serves again.
      await streamsThrough(`Redis frozen past the workers' TTL, round ${round}`, 4 + round, async () => {
        cluster.redis.process.signal('SIGSTOP');
        await new Promise((resolve) => setTimeout(resolve, 2_000 + (round % 3) * 1_000));
        cluster.redis.process.signal('SIGCONT');
      });
      await streamsThrough(`Redis frozen and a worker SIGKILLed meanwhile, round ${round}`, 4 + round, async () => {
        cluster.redis.process.signal('SIGSTOP');
        try {
          await new Promise((resolve) => setTimeout(resolve, 1_000));
          workers.shift()!.process.child.kill('SIGKILL');
          await new Promise((resolve) => setTimeout(resolve, 1_500));
        } finally {
          cluster.redis.process.signal('SIGCONT');
        }
      });
      workers.push(await cluster.worker(WORKER_ENV));

      await streamsThrough(`worker drained, round ${round}`, 5 + round, async () => {
        workers.shift()!.process.signal('SIGTERM');
      });
      workers.push(await cluster.worker(WORKER_ENV));

      // Clients gone (within their grace) and their worker SIGKILLed: resumed on the other gateway, at
      // once or a moment later, they get the rest (migrated) from their cursors.
      {
        const leaving = PROMPTS.slice(0, 2).map((prompt) => post(gateways[0]!, chatBody(prompt, MAX_TOKENS)));
        const before = await Promise.all(leaving.map((p) => readReply(p.reply, afterTextChunks(4 + round))));
        for (const p of leaving) p.leave();
        workers.shift()!.process.child.kill('SIGKILL');
        await new Promise((resolve) => setTimeout(resolve, (round % 2) * 300));
        for (const [i, got] of before.entries()) {
          const rest = await readReply(resume(gateways[1]!, got.id!, got.lastEventId));
          const why = notWhole({ ...rest, text: got.text + rest.text }, answers.get(PROMPTS[i]!)!);
          if (why !== undefined) failures.push(`client gone and worker SIGKILLed, round ${round} (${PROMPTS[i]}): ${why}`);
        }
        workers.push(await cluster.worker(WORKER_ENV));
      }

      // A gateway SIGKILLed while its requests still wait (workers frozen): resumed on the other, whole.
      {
        for (const worker of workers) worker.process.signal('SIGSTOP');
        const victim = gateways.shift()!;
        let ids: string[];
        try {
          const replies = await Promise.all(PROMPTS.slice(0, 2).map((prompt) => post(victim, chatBody(prompt, MAX_TOKENS)).reply));
          ids = replies.map((res) => res.headers.get('x-stream-id')!);
          victim.process.child.kill('SIGKILL');
          await victim.process.exited;
        } finally {
          for (const worker of workers) worker.process.signal('SIGCONT');
        }
        for (const [i, id] of ids.entries()) {
          const why = notWhole(await readReply(resume(gateways[0]!, id)), answers.get(PROMPTS[i]!)!);
          if (why !== undefined) failures.push(`gateway SIGKILLed while queued, round ${round} (${PROMPTS[i]}): ${why}`);
        }
        gateways.push(await cluster.gateway(MIGRATING_GATEWAY_ENV));
      }

      // A gateway SIGKILLed: its clients resume on the other from their cursors.
      const victim = gateways.shift()!;
      const firsts = PROMPTS.slice(0, 2).map((prompt) =>
        readReply(post(victim, chatBody(prompt, MAX_TOKENS)).reply, afterTextChunks(4 + round)),
      );
      const before = await Promise.all(firsts);
      victim.process.child.kill('SIGKILL');
      for (const [i, got] of before.entries()) {
        const rest = await readReply(resume(gateways[0]!, got.id!, got.lastEventId));
        const why = notWhole({ ...rest, text: got.text + rest.text }, answers.get(PROMPTS[i]!)!);
        if (why !== undefined) failures.push(`gateway SIGKILLed, round ${round} (${PROMPTS[i]}): ${why}`);
      }
      gateways.push(await cluster.gateway(MIGRATING_GATEWAY_ENV));
    }
    redis.disconnect();
    expect(failures, `${failures.length} answers not whole:\n${failures.join('\n')}\n${cluster.logs()}`).toEqual([]);
  });
});
