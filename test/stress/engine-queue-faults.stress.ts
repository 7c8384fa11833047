import { describe, expect, it } from 'vitest';
import { sleep } from '../support/processes.js';
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
 * under way, one worker is SIGKILLed (its requests migrate), drained (handed over) or frozen past its
 * registry TTL and thawed (its requests move; it is fenced out), in turn, and every answer must arrive
 * whole, the waiting ones included.
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
      const fault = (['SIGKILLed', 'drained', 'frozen'] as const)[round % 3]!;
      const worker = workers.shift()!;
      if (fault === 'drained') worker.process.signal('SIGTERM');
      else if (fault === 'SIGKILLed') worker.process.child.kill('SIGKILL');
      else {
        // Past its registry TTL (1.5 s): its requests move, accepted or not; thawed, it is fenced out.
        worker.process.signal('SIGSTOP');
        await sleep(3_000);
        worker.process.signal('SIGCONT');
      }
      (await Promise.all(runs)).forEach((got, i) => {
        const why = notWhole(got, answers.get(PROMPTS[i]!)!);
        if (why !== undefined) failures.push(`round ${round}, worker ${fault} (${PROMPTS[i]}): ${why}`);
      });
      workers.push(fault === 'frozen' ? worker : await cluster.worker(WORKER_ENV));
    }
    expect(failures, `${failures.length} answers not whole:\n${failures.join('\n')}\n${cluster.logs()}`).toEqual([]);
  });
});
