import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { sleep } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import { checkChunkSequence, LiveStream } from './support/sse.js';
import type { GatewayProcess } from './support/sluice.js';

/**
 * Redis stalls (frozen with SIGSTOP: a slow command, a fork, a paused VM) for longer than the workers'
 * registry TTL while streams run: every record expires meanwhile, and every worker's beats wait in its
 * socket. Real redis-server, BullMQ, one gateway and two workers on the tiny model. A registry read
 * that judged the workers lost on that one read moved every stream (and, before the fixes beside it,
 * ended some `worker_lost`: the move found the job settled and its log not yet read to its end).
 */
describe('when Redis stalls past the workers’ registry TTL', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  const workerEnv = { WORKER_TTL_MS: '1000', WORKER_HEARTBEAT_MS: '200' };

  beforeAll(async () => {
    cluster = await Cluster.start();
    await cluster.worker(workerEnv);
    await cluster.worker(workerEnv);
    gateway = await cluster.gateway();
  });

  afterAll(async () => {
    await cluster.stop();
  });

  it('takes it for no loss: every stream goes on where it was, token-identical, and none moves', async () => {
    const body = { model: MODEL, prompt: 'Once upon a time', max_tokens: 400, ignore_eos: true, temperature: 0, stream: true };
    const reference = new LiveStream(`${gateway.url}/v1/completions`, body);
    await reference.ended;
    const whole = checkChunkSequence(reference.items, 'completion', false).text;
    const streams = Array.from({ length: 6 }, () => new LiveStream(`${gateway.url}/v1/completions`, body));
    for (const stream of streams) await stream.until('its first tokens', () => stream.contentChunks > 0);

    cluster.redis.process.signal('SIGSTOP');
    // Well past the TTL (1 s): every record has expired when Redis serves again.
    await sleep(2_500);
    cluster.redis.process.signal('SIGCONT');

    expect(await Promise.all(streams.map((stream) => stream.ended))).toEqual(streams.map(() => 'done'));
    for (const stream of streams) expect(checkChunkSequence(stream.items, 'completion', false).text).toBe(whole);
    const metrics = await scrapePrometheus(`${gateway.url}/metrics`);
    expect(metrics.value('sluice_gateway_stream_migrations_total')).toBe(0);
  });
});
