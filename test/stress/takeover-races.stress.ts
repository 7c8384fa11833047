import { describe, expect, it } from 'vitest';
import { afterTextChunks, chatBody, notWhole, oneWorkerTwoGateways, post, readReply, resume, ROUNDS } from './stress-support.js';

/**
 * Races between deliveries of one request, looped (`npm run stress`; not in the default suite): two
 * gateways, one worker (tiny model), real processes. Each round runs every case with a short queue
 * and idle timeout, so a delivery left waiting shows within seconds, and reports each delivery that
 * is not the whole answer. Found: a resume that waited out its queue timeout (5c8e82f), the first of
 * two POSTs with one Idempotency-Key that did (8d08a5f), a resume whose old connection's cancel still
 * won (681f557).
 */
describe('takeover races, looped', () => {
  const stack = oneWorkerTwoGateways({ HEADERS_WAIT_MS: '200', QUEUE_TIMEOUT_MS: '5000', IDLE_TIMEOUT_MS: '5000' });

  it(`delivers every answer whole, ${ROUNDS} rounds`, async () => {
    const { gateways, withWorkerFrozen } = stack;
    const failures: string[] = [];
    const answers = new Map<string, string>();
    const answer = async (content: string) => {
      if (!answers.has(content)) answers.set(content, (await readReply(post(gateways[0]!, chatBody(content, 60)).reply)).text);
      return answers.get(content)!;
    };
    const check = (what: string, got: Parameters<typeof notWhole>[0], expected: string) => {
      const why = notWhole(got, expected);
      if (why !== undefined) failures.push(`${what}: ${why}`);
    };
    for (let round = 0; round < ROUNDS; round++) {
      const content = `stress ${round % 5}`;
      const expected = await answer(content);
      const [here, there] = round % 2 === 0 ? [gateways[0]!, gateways[1]!] : [gateways[1]!, gateways[0]!];

      // A client leaves mid-stream and resumes on the other gateway from its cursor.
      const first = post(here, chatBody(content, 60));
      const before = await readReply(first.reply, afterTextChunks(1 + (round % 20)));
      first.leave();
      const rest = await readReply(resume(there, before.id!, before.lastEventId));
      check(`resume mid-stream, round ${round}`, { ...rest, text: before.text + rest.text }, expected);

      // The worker frozen, the client gone before anything came, resumed elsewhere as the worker wakes.
      const id = await withWorkerFrozen(true, async () => {
        const gone = post(here, chatBody(content, 60));
        const res = await gone.reply;
        gone.leave();
        return res.headers.get('x-stream-id')!;
      });
      check(`resume of a waiting request, round ${round}`, await readReply(resume(there, id)), expected);

      // Two POSTs with one Idempotency-Key on two gateways at once: the later takes the delivery over, the
      // earlier reads on from the log; one of them may be refused 409 (the other's claim, no meta yet).
      const key = `stress-${round}-${Math.random()}`;
      const [a, b] = await withWorkerFrozen(round % 2 === 1, async () => {
        const a = post(here, chatBody(content, 60), { 'idempotency-key': key });
        await new Promise((resolve) => setTimeout(resolve, round % 4));
        const b = post(there, chatBody(content, 60), { 'idempotency-key': key });
        await Promise.allSettled([a.reply, b.reply]);
        return [a, b];
      });
      for (const [name, got] of [
        ['first', await readReply(a.reply)],
        ['second', await readReply(b.reply)],
      ] as const) {
        if (got.errors.some((e) => String(e).startsWith('409 '))) continue;
        check(`one Idempotency-Key twice, ${name}, round ${round}`, got, expected);
      }

      // Two resumes racing on two gateways while the first connection still reads: the resumes get the
      // whole answer; the first connection too, unless the resume on its own gateway superseded it.
      const open = post(here, chatBody(content, 60));
      const [res, resumes] = await withWorkerFrozen(round % 2 === 1, async () => {
        const res = await open.reply;
        const streamId = res.headers.get('x-stream-id')!;
        return [res, [resume(there, streamId), resume(here, streamId)]] as const;
      });
      const [firstGot, ...resumed] = await Promise.all([readReply(res), ...resumes.map((r) => readReply(r))]);
      if (!firstGot.errors.some((e) => JSON.stringify(e).includes('stream_interrupted')))
        check(`first of two resumes, round ${round}`, firstGot, expected);
      resumed.forEach((got, k) => check(`resume ${k} of two, round ${round}`, got, expected));

      // The first client (no grace) leaves as soon as a resume elsewhere answered: the work goes on for it.
      const graceless = post(here, chatBody(content, 60, { resume_grace_ms: 0 }));
      const streamId = (await graceless.reply).headers.get('x-stream-id')!;
      const taken = await resume(there, streamId);
      graceless.leave();
      check(`resume, then the first client leaves, round ${round}`, await readReply(taken), expected);

      // A cancel from the other gateway racing the pickup: the stream ends at once, never hangs.
      const cancelled = post(here, chatBody(content, 400, { resume_grace_ms: 0 }));
      const cancelledRes = await cancelled.reply;
      await new Promise((resolve) => setTimeout(resolve, round % 3));
      const cancel = await fetch(`${there.url}/v1/chat/completions/${cancelledRes.headers.get('x-stream-id')}/cancel`, { method: 'POST' });
      const ended = await readReply(cancelledRes);
      if (cancel.status !== 200 || !ended.done || ended.errors.length > 0) {
        failures.push(`cancel racing the pickup, round ${round}: ${cancel.status} ${JSON.stringify(ended)}`);
      }
    }
    expect(failures, `${failures.length} deliveries not whole:\n${failures.join('\n')}`).toEqual([]);
  });
});
