import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { decodeLogRange, redisNames } from '@sluice/protocol';
import { Cluster, MODEL } from './support/cluster.js';
import { freezeMidAnswers, retryMidAnswer, thaw } from './support/mid-answer.js';
import { waitFor } from './support/processes.js';
import { LiveStream } from './support/sse.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * A cancel is a pub/sub message: a worker whose control subscriber is reconnecting when it goes out
 * never hears it. The gateway notices by the entries that keep coming for a request it cancelled, and
 * cancels it again, so the work stops instead of running to max_tokens. Real redis-server, gateway and
 * worker (the tiny model); the worker frozen with SIGSTOP while its subscriber's connection is killed
 * (CLIENT KILL), so the cancel is lost whatever the machine's speed. When the subscriber is back, the
 * worker reads the running requests' cancel markers (the gateway's cancel set one) and stops them.
 */
const MAX_TOKENS = 2000;
const names = redisNames('sluice');

describe('control messages the worker never heard', () => {
  let cluster: Cluster;
  let redis: Redis;
  let worker: WorkerProcess;
  let gateway: GatewayProcess;

  beforeAll(async () => {
    cluster = await Cluster.start();
    // A long TTL: the worker is frozen below, and must not look lost meanwhile.
    worker = await cluster.worker({ WORKER_TTL_MS: '60000' });
    gateway = await cluster.gateway();
    redis = cluster.redis.client();
  }, 120_000);

  afterAll(async () => {
    thaw([worker]);
    redis?.disconnect();
    await cluster?.stop();
  });

  /** Kills the (frozen) worker's control subscriber connection: it cannot reconnect until thawed. */
  async function killSubscriber(): Promise<void> {
    const clients = String(await redis.client('LIST'));
    const line = clients.split('\n').find((client) => / name=sluice-worker:\S+:subscriber /.test(` ${client} `));
    expect(line, clients).toBeDefined();
    await redis.client('KILL', 'ID', /\bid=(\d+)/.exec(line!)![1]!);
  }

  /** A stream of `body` mid-answer whatever the machine's speed: the worker frozen with it unfinished in its log. */
  const frozenMidStream = (body: Record<string, unknown>) =>
    retryMidAnswer('the stream', async () => {
      const s = new LiveStream(`${gateway.url}/v1/completions`, body);
      await s.until('streaming', () => s.contentChunks >= 2);
      if ((await freezeMidAnswers([worker], redis, [s], MAX_TOKENS)) !== null) return s;
      s.abort();
      await s.ended;
      return undefined;
    });

  /** The request's log once it has ended: its entries. */
  const endedLog = (jobId: string) =>
    waitFor(
      'the request ended',
      async () => {
        const entries = decodeLogRange(await redis.xrange(names.logKey(jobId), '-', '+'));
        return entries.some((entry) => entry.type === 'finish' || entry.type === 'error') ? entries : undefined;
      },
      60_000,
    );

  /**
   * A stream mid-answer whose client leaves while the (frozen) worker's control subscriber is away: the
   * gateway's cancel goes out and no worker hears it. The worker stays frozen.
   */
  async function loseCancel(prompt: string): Promise<{ jobId: string; heard: string[]; spy: Redis }> {
    const stream = await frozenMidStream({ model: MODEL, prompt, max_tokens: MAX_TOKENS, temperature: 0, ignore_eos: true, stream: true });
    const heard: string[] = [];
    const spy = cluster.redis.client();
    await killSubscriber();
    await spy.subscribe(names.controlChannel);
    spy.on('message', (_channel: string, raw: string) => heard.push(raw));
    stream.abort();
    await waitFor('the cancel published', () => (heard.some((raw) => raw.includes(stream.jobId)) ? true : undefined));
    return { jobId: stream.jobId, heard, spy };
  }

  /** The request's answer ended `abort`, short of max_tokens: its work stopped. */
  async function expectStopped(jobId: string): Promise<void> {
    const log = await endedLog(jobId);
    expect(log.filter((entry) => entry.type === 'text-end')).toMatchObject([{ finishReason: 'abort' }]);
    const tokens = log.reduce((sum, entry) => sum + (entry.type === 'text-delta' ? (entry.tokenIds?.length ?? 0) : 0), 0);
    expect(tokens).toBeLessThan(MAX_TOKENS);
  }

  it('is sent again while the cancelled request keeps publishing, and the work stops', async () => {
    const { jobId, heard, spy } = await loseCancel('A story that nobody reads');
    try {
      // Past the gateway's resend interval (1 s) before the worker runs again: its next entries are
      // reason enough to send the cancel again. (The worker also reads the marker back once its
      // subscriber is back: either stops the work.)
      await new Promise((resolve) => setTimeout(resolve, 1_200));
      thaw([worker]);
      await expectStopped(jobId);
      expect(heard.filter((raw) => raw.includes(jobId)).length).toBeGreaterThanOrEqual(2);
    } finally {
      thaw([worker]);
      spy.disconnect();
    }
  }, 120_000);

  it('is read back from its marker when the subscriber reconnects, with no gateway left to send it again', async () => {
    const { jobId, heard, spy } = await loseCancel('A story that nobody reads, twice');
    try {
      // The gateway cannot send it again: only the marker its cancel set tells the worker.
      gateway.process.signal('SIGSTOP');
      thaw([worker]);
      await expectStopped(jobId);
      expect(heard.filter((raw) => raw.includes(jobId))).toHaveLength(1);
    } finally {
      thaw([worker]);
      gateway.process.signal('SIGCONT');
      spy.disconnect();
    }
  }, 120_000);

  it('a detach the worker never heard is read back from the meta when its subscriber reconnects: the grace still ends the work', async () => {
    const body = {
      model: MODEL,
      prompt: 'A story whose reader walks away',
      max_tokens: MAX_TOKENS,
      temperature: 0,
      ignore_eos: true,
      stream: true,
      resume_grace_ms: 500,
    };
    const stream = await frozenMidStream(body);
    const jobId = stream.jobId;
    try {
      await killSubscriber();
      // The client leaves within its grace: the gateway detaches the request (its meta's route cleared)
      // and tells the worker, which does not hear it.
      stream.abort();
      await waitFor('the request detached', async () => ((await redis.hget(names.metaKey(jobId), 'channel')) === '' ? true : undefined));
      // The grace (0.5 s) runs out while the worker is frozen.
      await new Promise((resolve) => setTimeout(resolve, 700));
    } finally {
      thaw([worker]);
    }
    await expectStopped(jobId);
  }, 120_000);
});
