import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import { decodeGatewayMessage } from '@sluice/protocol';
import { StepPublisher } from '../src/step-publisher.js';

/** A stand-in for the ioredis pipeline: records each exec()'s publishes. */
function fakeRedis() {
  const execs: Array<Array<[string, string]>> = [];
  return {
    execs,
    redis: {
      pipeline() {
        const publishes: Array<[string, string]> = [];
        const pipeline = {
          publish: (channel: string, message: string) => {
            publishes.push([channel, message]);
            return pipeline;
          },
          exec: async () => {
            execs.push(publishes);
            return [];
          },
        };
        return pipeline;
      },
    },
  };
}

describe('StepPublisher', () => {
  it('publishes one message per gateway channel for everything pushed in one macrotask', async () => {
    const { redis, execs } = fakeRedis();
    const publisher = new StepPublisher(redis as never, 'w1', pino({ level: 'silent' }));
    // One engine step: three requests of gateway A, one of gateway B.
    for (const id of ['a1', 'a2', 'a3']) publisher.push('gw:A', { requestId: id, type: 'text-delta', index: 0, text: id, tokens: 1 });
    publisher.push('gw:B', { requestId: 'b1', type: 'text-delta', index: 0, text: 'b', tokens: 1 });
    await publisher.drained();
    expect(execs).toHaveLength(1);
    expect(execs[0]!.map(([channel]) => channel)).toEqual(['gw:A', 'gw:B']);
    const a = decodeGatewayMessage(execs[0]![0]![1]);
    expect(a.workerId).toBe('w1');
    expect(a.entries.map((e) => e.requestId)).toEqual(['a1', 'a2', 'a3']);
  });

  it('numbers each request’s entries 0, 1, 2, ... across steps', async () => {
    const { redis, execs } = fakeRedis();
    const publisher = new StepPublisher(redis as never, 'w1', pino({ level: 'silent' }));
    publisher.push('gw', { requestId: 'r', type: 'accepted', workerId: 'w1', promptTokens: 2 });
    await publisher.drained();
    publisher.push('gw', { requestId: 'r', type: 'text-delta', index: 0, text: 'x', tokens: 1 });
    publisher.push('gw', { requestId: 'other', type: 'accepted', workerId: 'w1', promptTokens: 1 });
    publisher.push('gw', { requestId: 'r', type: 'text-end', index: 0, finishReason: 'stop' });
    await publisher.drained();
    const seqs = execs.flatMap((publishes) => publishes.flatMap(([, raw]) => decodeGatewayMessage(raw).entries.map((e) => `${e.requestId}:${e.seq}`)));
    expect(seqs).toEqual(['r:0', 'r:1', 'other:0', 'r:2']);
  });
});
