import { describe, expect, it } from 'vitest';
import { Scheduler, type SchedulableGroup } from '../src/scheduler.js';

class Group implements SchedulableGroup {
  prefilled = 0;
  rows: number;
  constructor(
    readonly name: string,
    readonly promptLength: number,
    maxTokens: number,
    n = 1,
  ) {
    this.rows = n;
    this.reservedLength = promptLength + maxTokens;
  }
  readonly reservedLength: number;
}

/** Applies a plan the way the engine does: chunks advance prefill; complete prompts start decoding. */
function runStep(scheduler: Scheduler<Group>) {
  const plan = scheduler.plan();
  for (const chunk of plan.prefill) {
    chunk.group.prefilled += chunk.length;
    if (chunk.group.prefilled === chunk.group.promptLength) scheduler.markPrefilled(chunk.group);
  }
  return plan;
}

const limits = { maxBatchSize: 4, maxStepTokens: 24, maxCachedTokens: 10_000 };
/** A step budget close to the batch size: pieces of 16 − 4 + 1 = 13 would be under MIN_FIXED_PIECE. */
const tightLimits = { maxBatchSize: 4, maxStepTokens: 16, maxCachedTokens: 10_000 };

describe('Scheduler', () => {
  it('admits newcomers in arrival order while their first pieces fit the step budget', () => {
    const scheduler = new Scheduler<Group>(limits);
    const [a, b, c] = [new Group('a', 5, 4), new Group('b', 5, 4), new Group('c', 20, 4)];
    for (const group of [a, b, c]) scheduler.enqueue(group);
    let plan = runStep(scheduler);
    expect(plan.admitted.map((g) => g.name)).toEqual(['a', 'b']);
    expect(plan.prefill.map((chunk) => [chunk.group.name, chunk.start, chunk.length])).toEqual([
      ['a', 0, 5],
      ['b', 0, 5],
    ]);
    expect(plan.decodeRows).toBe(0);
    // c's 20 tokens did not fit the 14 left: whole at the next step, not 14 + 6.
    plan = runStep(scheduler);
    expect(plan.admitted.map((g) => g.name)).toEqual(['c']);
    expect(plan.prefill.map((chunk) => [chunk.group.name, chunk.start, chunk.length])).toEqual([['c', 0, 20]]);
    expect(plan.decodeRows).toBe(2);
  });

  it('gives running rows one decode token each and prompt pieces the rest of the budget', () => {
    const scheduler = new Scheduler<Group>(limits);
    const short = new Group('short', 3, 8);
    scheduler.enqueue(short);
    runStep(scheduler);
    const long = new Group('long', 60, 8);
    scheduler.enqueue(long);
    const chunks: number[] = [];
    for (let step = 0; step < 3; step++) {
      const plan = runStep(scheduler);
      expect(plan.decodeRows).toBe(1); // the short request keeps decoding during the long prefill
      chunks.push(...plan.prefill.map((chunk) => chunk.length));
    }
    // Pieces of 24 − 4 + 1 = 21 (what a step holds beside a full batch's other rows).
    expect(chunks).toEqual([21, 21, 18]);
    expect(scheduler.running).toEqual([short, long]);
  });

  it('cuts a prompt at the same places whatever else runs, and never into a one-token piece', () => {
    const cuts = (decoding: number, promptLength: number) => {
      const scheduler = new Scheduler<Group>(limits);
      const others = Array.from({ length: decoding }, (_, i) => new Group(`d${i}`, 1, 100));
      for (const group of others) scheduler.enqueue(group);
      if (decoding > 0) runStep(scheduler);
      const prompt = new Group('prompt', promptLength, 4);
      scheduler.enqueue(prompt);
      const pieces: number[] = [];
      while (!scheduler.running.includes(prompt)) pieces.push(...runStep(scheduler).prefill.map((chunk) => chunk.length));
      return pieces;
    };
    // They used to follow the budget the decode rows left: 24 + 26 alone, 21 + 21 + 8 beside three rows.
    for (const decoding of [0, 1, 2, 3]) expect(cuts(decoding, 50), `${decoding} decoding`).toEqual([21, 21, 8]);
    // 22 tokens: 20 + 2, not 21 + 1 (a one-token call of GroupQueryAttention takes its decode path, whose
    // keys and values differ in the last bits).
    for (const decoding of [0, 3]) expect(cuts(decoding, 22)).toEqual([20, 2]);
  });

  it('with a step budget close to the batch size, gives prompts what each step leaves, never a one-token piece', () => {
    // 17 tokens in a 16-token step: 15 + 2, not 16 + 1 (a one-token call of GroupQueryAttention takes
    // its decode path, whose keys and values differ in the last bits).
    const scheduler = new Scheduler<Group>(tightLimits);
    const prompt = new Group('prompt', 17, 4);
    scheduler.enqueue(prompt);
    expect(runStep(scheduler).prefill.map((chunk) => chunk.length)).toEqual([15]);
    expect(runStep(scheduler).prefill.map((chunk) => chunk.length)).toEqual([2]);

    // A budget of one (three rows decoding in a four-token step) prefills nothing: the prompt waits.
    const tight = new Scheduler<Group>({ maxBatchSize: 4, maxStepTokens: 4, maxCachedTokens: 10_000 });
    const decoding = ['x', 'y', 'z'].map((name) => new Group(name, 1, 100));
    for (const group of decoding) tight.enqueue(group);
    runStep(tight);
    const waiting = new Group('waiting', 5, 4);
    tight.enqueue(waiting);
    const plan = runStep(tight);
    expect(plan.decodeRows).toBe(3);
    expect(plan.admitted).toEqual([]);
    expect(plan.prefill).toEqual([]);
    for (const group of decoding) tight.remove(group);
    // Five tokens in a four-token step: 3 + 2, not 4 + 1.
    expect(runStep(tight).prefill.map((chunk) => [chunk.group.name, chunk.length])).toEqual([['waiting', 3]]);
    expect(runStep(tight).prefill.map((chunk) => [chunk.group.name, chunk.length])).toEqual([['waiting', 2]]);
    expect(tight.running).toEqual([waiting]);
  });

  it('prefills one token at a time when the step itself holds one token', () => {
    const scheduler = new Scheduler<Group>({ maxBatchSize: 1, maxStepTokens: 1, maxCachedTokens: 10_000 });
    const prompt = new Group('prompt', 3, 1);
    scheduler.enqueue(prompt);
    const chunks = [0, 1, 2].flatMap(() => runStep(scheduler).prefill.map((chunk) => chunk.length));
    expect(chunks).toEqual([1, 1, 1]);
    expect(scheduler.running).toEqual([prompt]);
  });

  it('takes at most a given prompt budget, below what the step leaves', () => {
    const scheduler = new Scheduler<Group>(limits);
    const [a, b, c] = [new Group('a', 5, 4), new Group('b', 5, 4), new Group('c', 5, 4)];
    for (const group of [a, b, c]) scheduler.enqueue(group);
    const plan = scheduler.plan(12);
    expect(plan.admitted.map((g) => g.name)).toEqual(['a', 'b']);
    expect(plan.prefill.reduce((sum, chunk) => sum + chunk.length, 0)).toBe(10);
    expect(scheduler.plan(0).prefill).toEqual([]);
  });

  it('starts a newcomer at the next step even when others are mid-generation', () => {
    const scheduler = new Scheduler<Group>(limits);
    const first = new Group('first', 4, 100);
    scheduler.enqueue(first);
    runStep(scheduler);
    runStep(scheduler);
    const late = new Group('late', 4, 4);
    scheduler.enqueue(late);
    const plan = runStep(scheduler);
    expect(plan.admitted).toEqual([late]);
    expect(scheduler.running).toEqual([first, late]);
  });

  it('keeps a request waiting while the batch has no free row, and admits it when one frees', () => {
    const scheduler = new Scheduler<Group>({ ...limits, maxBatchSize: 3 });
    const pair = new Group('pair', 2, 4, 2);
    const one = new Group('one', 2, 4);
    const next = new Group('next', 2, 4);
    for (const group of [pair, one, next]) scheduler.enqueue(group);
    expect(runStep(scheduler).admitted).toEqual([pair, one]);
    expect(runStep(scheduler).admitted).toEqual([]);
    scheduler.remove(one);
    expect(runStep(scheduler).admitted).toEqual([next]);
  });

  it('admits only what the KV cap holds in the worst case (rows × longest reservation)', () => {
    const scheduler = new Scheduler<Group>({ ...limits, maxCachedTokens: 100 });
    const a = new Group('a', 10, 30); // 40 slots
    const b = new Group('b', 5, 5); // alone 10, but the batch pads it to 40: 2 × 40 = 80
    const c = new Group('c', 5, 5); // 3 × 40 = 120 > 100: waits
    for (const group of [a, b, c]) scheduler.enqueue(group);
    expect(runStep(scheduler).admitted).toEqual([a, b]);
    expect(scheduler.waiting).toEqual([c]);
    scheduler.remove(a);
    expect(runStep(scheduler).admitted).toEqual([c]);
  });

  it('never lets a later request overtake the head of the queue', () => {
    const scheduler = new Scheduler<Group>({ ...limits, maxCachedTokens: 100 });
    const running = new Group('running', 10, 40);
    scheduler.enqueue(running);
    runStep(scheduler);
    const big = new Group('big', 10, 50); // 2 × 60 > 100
    const small = new Group('small', 1, 1); // would fit, but must not pass big
    scheduler.enqueue(big);
    scheduler.enqueue(small);
    expect(runStep(scheduler).admitted).toEqual([]);
  });

  it('forgets removed groups wherever they are', () => {
    const scheduler = new Scheduler<Group>(limits);
    const [a, b, c] = [new Group('a', 30, 1), new Group('b', 2, 1), new Group('c', 2, 1)];
    scheduler.enqueue(a);
    scheduler.enqueue(b);
    runStep(scheduler); // the whole budget goes to a: b still waits
    scheduler.enqueue(c);
    scheduler.remove(a);
    scheduler.remove(c);
    expect([...scheduler.waiting, ...scheduler.prefilling, ...scheduler.running]).toEqual([b]);
  });
});
