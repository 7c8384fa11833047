import { describe, expect, it } from 'vitest';
import { createKey } from '../support/api-keys.js';
import { chatBody, oneWorkerTwoGateways, post, readReply, ROUNDS } from './stress-support.js';

/**
 * A `--max-streams` key under churn, looped (`npm run stress`; not in the default suite): two gateways
 * with API keys, one worker (tiny model). Each round sends three times the key's streams at once over
 * both gateways with the worker frozen — exactly its limit is admitted, the rest 429 — then its
 * clients leave at scattered moments (without a grace the work stops; with one, every other round, they
 * resume on the other gateway), read to the end, or cancel from the other gateway, and once all ended
 * the key admits exactly its limit again: no slot leaks, none is counted twice.
 */
const MAX_STREAMS = 3;

describe('a max-streams key under churn, looped', () => {
  const stack = oneWorkerTwoGateways({ AUTH: 'keys', HEADERS_WAIT_MS: '100' });

  it(`admits exactly the key's streams, ${ROUNDS} rounds`, async () => {
    const { cluster, gateways } = stack;
    const key = await createKey(cluster.redis.url, ['--name', 'churn', '--max-streams', String(MAX_STREAMS)]);
    const auth = { authorization: `Bearer ${key}` };
    const failures: string[] = [];
    /** Sends 3 × MAX_STREAMS streams at once with the worker frozen; how many were admitted, and their handles. */
    const burst = (round: number, graceMs: number) =>
      stack.withWorkerFrozen(true, async () => {
        const sent = Array.from({ length: 3 * MAX_STREAMS }, (_, i) =>
          post(gateways[i % 2]!, chatBody(`churn ${round} ${i}`, 200, { resume_grace_ms: graceMs }), auth),
        );
        const replies = await Promise.all(sent.map((s) => s.reply));
        const admitted = sent.filter((_, i) => replies[i]!.status === 200);
        const refused = replies.filter((r) => r.status === 429).length;
        if (admitted.length !== MAX_STREAMS || refused !== 2 * MAX_STREAMS) {
          failures.push(`round ${round}: ${admitted.length} admitted, ${refused} refused (${replies.map((r) => r.status).join(' ')})`);
        }
        for (const r of replies) if (r.status !== 200) await r.text();
        return admitted.map((s) => ({ ...s, res: replies[sent.indexOf(s)]! }));
      });
    for (let round = 0; round < ROUNDS; round++) {
      // Odd rounds: streams with a resume grace, whose clients that leave resume on the other gateway.
      const grace = round % 2 === 1;
      const admitted = await burst(round, grace ? 30_000 : 0);
      // Each admitted client: leaves after a few ms (and resumes, with a grace), reads to its end, or is
      // cancelled from the other gateway.
      await Promise.all(
        admitted.map(async ({ res, leave }, i) => {
          const how = (round + i) % 3;
          if (how === 0) {
            await new Promise((resolve) => setTimeout(resolve, (round * 7 + i * 3) % 20));
            leave();
            if (grace) {
              const id = res.headers.get('x-stream-id')!;
              await readReply(fetch(`${gateways[(i + 1) % 2]!.url}/v1/chat/completions/${id}?stream=true`, { headers: auth }));
            }
          } else if (how === 1) {
            await readReply(res);
          } else {
            const id = res.headers.get('x-stream-id')!;
            await fetch(`${gateways[(i + 1) % 2]!.url}/v1/chat/completions/${id}/cancel`, { method: 'POST', headers: auth });
            await readReply(res);
          }
        }),
      );
      // The slots come back once the work stopped: a burst admits exactly the limit again.
      let free = false;
      for (let tries = 0; tries < 50 && !free; tries++) {
        const probe = post(gateways[tries % 2]!, chatBody('probe', 1), auth);
        const res = await probe.reply;
        free = res.status === 200;
        await res.text();
        if (!free) await new Promise((resolve) => setTimeout(resolve, 100));
      }
      if (!free) failures.push(`round ${round}: the key admitted nothing 5 s after its streams ended`);
    }
    expect(failures, `${failures.length} rounds wrong:\n${failures.join('\n')}`).toEqual([]);
  });
});
