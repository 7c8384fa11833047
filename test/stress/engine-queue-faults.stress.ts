import { describe, expect, it } from 'vitest';
import {
  chatBody,
  MIGRATING_WORKER_ENV,
  notWhole,
  post,
  readReply,
  ROUNDS,
  twoWorkersTwoGateways,
  whenAllReach,
} from './stress-support.js';

/**
 * A worker lost with requests waiting inside its engine, looped (`npm run stress`; not in the default
 * suite): two workers of two batch rows that take four jobs each (tiny model), six long greedy streams
 * over two gateways, so that a worker holds some accepted but not yet scheduled. Once two streams are
 * under way, one worker is SIGKILLed (even rounds: its requests migrate) or drained (odd rounds: handed
 * over), and every answer must arrive whole, the waiting ones included.
 *
 * It found a gap (stop 53, fixed stop 54; docs/durable-streams.md "A worker lost between taking a job and
 * accepting it"): a worker SIGKILLed just after it took a job, before its `accepted`, left that request to
 * BullMQ's stalled-job check, 30–60 s later, and its client could reach the queue timeout first (under
 * `yes` load 1–2 of 60 requests per 10 rounds).
 */
const WORKER_ENV = { ...MIGRATING_WORKER_ENV, MAX_BATCH_SIZE: '2', WORKER_CONCURRENCY: '4' };
const PROMPTS = ['one', 'two', 'three', 'four', 'five', 'six'];

describe('a worker lost with requests waiting in its engine, looped', () => {
  const stack = twoWorkersTwoGateways(WORKER_ENV);

  it(`delivers every answer whole, ${ROUNDS} rounds`, async () => {
    const { cluster, workers, gateways } = stack;
    const failures: string[] = [];
    const answers = new Map<string, string>();
    for (const p of PROMPTS) answers.set(p, (await readReply(post(gateways[0]!, chatBody(p, 600)).reply)).text);
    for (let round = 0; round < ROUNDS; round++) {
      const progress = whenAllReach(2, 3 + round);
      const runs = PROMPTS.map((p, i) => readReply(post(gateways[i % 2]!, chatBody(p, 600)).reply, progress.until));
      await progress.reached;
      const drained = round % 2 === 1;
      if (drained) workers.shift()!.process.signal('SIGTERM');
      else workers.shift()!.process.child.kill('SIGKILL');
      (await Promise.all(runs)).forEach((got, i) => {
        const why = notWhole(got, answers.get(PROMPTS[i]!)!);
        if (why !== undefined) failures.push(`round ${round}, worker ${drained ? 'drained' : 'SIGKILLed'} (${PROMPTS[i]}): ${why}`);
      });
      workers.push(await cluster.worker(WORKER_ENV));
    }
    expect(failures, `${failures.length} answers not whole:\n${failures.join('\n')}\n${cluster.logs()}`).toEqual([]);
  });
});
