import { describe, expect, it } from 'vitest';
import {
  attemptJobId,
  batchRequestId,
  parseAttemptJobId,
  decodeControlMessage,
  decodeGatewayMessage,
  decodeRequestMeta,
  decodeWorkerRecord,
  encodeControlMessage,
  encodeRequestMeta,
  logEntryId,
  seqOfLogEntryId,
  encodeEntry,
  encodeGatewayMessage,
  encodeWorkerRecord,
  liveGatewayMessage,
  parseGenerateJob,
  redisNames,
  type GatewayEntry,
  type GatewayMessage,
} from '../src/index.js';

describe('gateway messages', () => {
  it('round-trips a step message carrying several requests', () => {
    const message: GatewayMessage = {
      workerId: 'w1',
      entries: [
        { requestId: 'a', seq: 0, type: 'accepted', workerId: 'w1', promptTokens: 5 },
        { requestId: 'b', seq: 3, type: 'text-delta', index: 0, text: 'hé', tokens: 1 },
        { requestId: 'b', seq: 4, type: 'text-end', index: 0, finishReason: 'length' },
        { requestId: 'b', seq: 5, type: 'finish', usage: { promptTokens: 5, completionTokens: 3 } },
        { requestId: 'c', seq: 0, type: 'rejected', error: { code: 'context_length_exceeded', message: 'x', param: 'prompt' } },
      ],
    };
    expect(decodeGatewayMessage(encodeGatewayMessage(message))).toEqual(message);
    expect(decodeGatewayMessage(Buffer.from(encodeGatewayMessage(message)))).toEqual(message);
  });

  it('writes an entry whole to the log and without its token ids to the channel', () => {
    const delta: GatewayEntry = {
      type: 'text-delta',
      index: 1,
      text: 'a"\n',
      tokens: 2,
      tokenIds: [7, 8],
      requestId: 'r',
      seq: 4,
      attempt: 2,
    };
    const { logged, live } = encodeEntry(delta);
    expect(JSON.parse(logged)).toEqual(delta);
    const { tokenIds: _, ...withoutIds } = delta;
    expect(JSON.parse(live)).toEqual(withoutIds);
    const accepted: GatewayEntry = { type: 'accepted', workerId: 'w', promptTokens: 3, requestId: 'r', seq: 0 };
    expect(encodeEntry(accepted)).toEqual({ logged: JSON.stringify(accepted), live: JSON.stringify(accepted) });
    // The channel's message from live forms decodes to the entries a gateway needs.
    expect(decodeGatewayMessage(liveGatewayMessage('w"1', [encodeEntry(accepted).live, live]))).toEqual({
      workerId: 'w"1',
      entries: [accepted, withoutIds],
    });
  });

  it('refuses an entry without a sequence number', () => {
    const raw = JSON.stringify({ workerId: 'w', entries: [{ requestId: 'a', type: 'text-delta', index: 0, text: '', tokens: 0 }] });
    expect(() => decodeGatewayMessage(raw)).toThrow();
  });
});

describe('control messages', () => {
  it('round-trips cancels and route changes', () => {
    const cancel = { type: 'cancel' as const, requestIds: ['a', 'b'], reason: 'client_closed' as const, channel: 'gw' };
    expect(decodeControlMessage(encodeControlMessage(cancel))).toEqual(cancel);
    const detach = { type: 'route' as const, requestId: 'a', channel: null, from: 'gw' };
    expect(decodeControlMessage(encodeControlMessage(detach))).toEqual(detach);
    expect(() => decodeControlMessage('{"requestIds":["a"],"reason":"client_closed"}')).toThrow();
  });

  it("reads a cancel for a reason it does not know (a newer gateway's) as a cancel", () => {
    expect(decodeControlMessage('{"type":"cancel","requestIds":["a"],"reason":"a_later_reason"}')).toEqual({
      type: 'cancel',
      requestIds: ['a'],
      reason: 'cancelled',
    });
    expect(() => decodeControlMessage('{"type":"cancel","requestIds":[],"reason":"cancelled"}')).toThrow();
  });
});

describe('request meta and the token log', () => {
  it('round-trips the meta hash and refuses a missing or malformed one', () => {
    const format = { endpoint: 'chat' as const, model: 'm', created: 7, includeUsage: true, n: 2, maxTokensParam: 'max_tokens' as const };
    const fields = encodeRequestMeta({ channel: 'gw', graceMs: 500, attempt: 1, enqueuedAt: 1, deadlineAt: 2, format });
    expect(decodeRequestMeta(fields)).toEqual({ channel: 'gw', graceMs: 500, attempt: 1, enqueuedAt: 1, deadlineAt: 2, format });
    expect(decodeRequestMeta({ ...fields, channel: '', detachedAt: '9', workerId: 'w' })).toMatchObject({
      channel: '',
      detachedAt: 9,
      workerId: 'w',
    });
    expect(decodeRequestMeta({})).toBeUndefined();
    expect(decodeRequestMeta({ ...fields, format: '{"endpoint":"x"}' })).toBeUndefined();
  });

  it('maps sequence numbers to stream ids and back', () => {
    expect(logEntryId(0)).toBe('0-1');
    expect(seqOfLogEntryId(logEntryId(41))).toBe(41);
  });
});

describe('worker records', () => {
  it('round-trips and ignores malformed records', () => {
    const record = {
      workerId: 'w',
      modelId: 'tiny',
      maxContextLength: 512,
      maxBatchSize: 8,
      startedAt: 1,
      heartbeatAt: 2,
      running: 0,
      draining: false,
    };
    expect(decodeWorkerRecord(encodeWorkerRecord(record))).toEqual(record);
    expect(decodeWorkerRecord('{"workerId":1}')).toBeUndefined();
    expect(decodeWorkerRecord('not json')).toBeUndefined();
  });
});

describe('generate jobs', () => {
  it('accepts a chat job and refuses an empty chat', () => {
    const job = {
      requestId: 'r',
      channel: 'sluice:gw:g',
      model: 'tiny',
      input: { kind: 'chat', messages: [{ role: 'user', content: 'hi' }] },
      sampling: { maxTokens: 4, temperature: 0 },
      defaultMaxTokens: 'context',
      enqueuedAt: 1,
      deadlineAt: 2,
      resumeGraceMs: 0,
    };
    expect(parseGenerateJob(job)).toEqual(job);
    expect(() => parseGenerateJob({ ...job, input: { kind: 'chat', messages: [] } })).toThrow();
  });
});

describe('names', () => {
  it('puts every key and channel under the prefix', () => {
    const names = redisNames('p');
    expect(names.gatewayChannel('g1')).toBe('p:gw:g1');
    expect(names.cancelMarkerKey('r')).toBe('p:cancelled:r');
    expect(names.workerKey('w')).toBe('p:worker:w');
  });

  it("keeps each request's keys in one Redis Cluster slot (a {id} hash tag)", () => {
    const names = redisNames('p');
    expect(names.logKey('r1')).toBe('p:{r1}:log');
    expect(names.metaKey('r1')).toBe('p:{r1}:meta');
  });

  it("reads a job's request and attempt back off its id", () => {
    const requestId = '0b6f3c52-9d1e-4a57-8f0e-2c4d6a8b1e33';
    for (const id of [requestId, batchRequestId(requestId, 3)]) {
      for (const attempt of [1, 2, 12]) expect(parseAttemptJobId(attemptJobId(id, attempt))).toEqual({ requestId: id, attempt });
    }
  });
});

describe('decodeGatewayMessage fast path', () => {
  it('accepts and refuses text-delta entries exactly as the zod schema does', async () => {
    const fc = await import('fast-check');
    const { gatewayMessageSchema } = await import('../src/index.js');
    const value = fc.oneof(
      fc.string(),
      fc.integer({ min: -3, max: 3 }),
      fc.double(),
      fc.constant(null),
      fc.constant(undefined),
      fc.boolean(),
    );
    const entry = fc.record(
      {
        requestId: fc.oneof(fc.string(), value),
        seq: fc.oneof(fc.nat(), value),
        type: fc.oneof(fc.constant('text-delta'), value),
        index: fc.oneof(fc.nat(), value),
        text: fc.oneof(fc.string(), value),
        tokens: fc.oneof(fc.nat(), value),
        tokenIds: fc.oneof(fc.array(fc.nat(), { maxLength: 3 }), fc.array(value, { maxLength: 2 }), value),
        attempt: fc.oneof(fc.nat(), value),
      },
      { requiredKeys: [] },
    );
    fc.assert(
      fc.property(fc.array(entry, { maxLength: 4 }), (entries) => {
        const raw = JSON.stringify({ workerId: 'w', entries });
        const bySchema = gatewayMessageSchema.safeParse(JSON.parse(raw));
        let fast: unknown;
        try {
          fast = decodeGatewayMessage(raw);
        } catch {
          fast = undefined;
        }
        expect(fast !== undefined).toBe(bySchema.success);
        if (bySchema.success) expect(fast).toEqual(bySchema.data);
      }),
      { numRuns: 2000 },
    );
    // Found by the property above: 2^53 is an integer to JavaScript but not to zod's .int().
    const unsafe = JSON.stringify({
      workerId: 'w',
      entries: [{ requestId: 'r', seq: 0, type: 'text-delta', index: 0, text: '', tokens: 2 ** 53 }],
    });
    expect(gatewayMessageSchema.safeParse(JSON.parse(unsafe)).success).toBe(false);
    expect(() => decodeGatewayMessage(unsafe)).toThrow();
  });
});
