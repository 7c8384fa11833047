import { describe, expect, it } from 'vitest';
import { z } from 'zod';
import { envFlag, envInput, envInt, envMs, MAX_TIMER_MS } from '../src/index.js';

/** The first issue's message of parsing `value` with `schema`, or the parsed number. */
function read(schema: z.ZodType<number>, value: string): number | string {
  const parsed = schema.safeParse(value);
  return parsed.success ? parsed.data : (parsed.error.issues[0]?.message ?? 'no message');
}

describe('an integer environment variable', () => {
  it('accepts plain decimal digits, blanks around them trimmed', () => {
    expect(read(envInt(0), '8080')).toBe(8080);
    expect(read(envInt(0), ' 8 ')).toBe(8);
    expect(read(envInt(-5), '-3')).toBe(-3);
  });

  it('refuses hexadecimal, exponents and decimals', () => {
    for (const value of ['0x1F90', '1e6', '8080.0', 'eighty', '+1']) {
      expect(read(envInt(0), value), value).toBe('must be a decimal integer');
    }
  });

  it('says the bound it passes', () => {
    expect(read(envInt(1), '0')).toBe('must be at least 1');
    expect(read(envInt(0, 65535), '65536')).toBe('must be at most 65535');
    expect(read(envInt(0, 10, 'too many'), '11')).toBe('too many');
    expect(read(envInt(0), String(Number.MAX_SAFE_INTEGER))).toBe(Number.MAX_SAFE_INTEGER);
    expect(read(envInt(0), '9007199254740993')).toMatch(/9007199254740991/);
  });
});

describe('a millisecond environment variable', () => {
  it("stops at Node's longest timer and says so", () => {
    expect(MAX_TIMER_MS).toBe(2_147_483_647);
    expect(read(envMs(0), '2147483647')).toBe(2_147_483_647);
    expect(read(envMs(0), '2147483648')).toBe("must be at most 2147483647 (ms, about 24.8 days: Node's longest timer)");
    expect(read(envMs(50), '10')).toBe('must be at least 50');
  });
});

describe('the set variables of an environment', () => {
  it('leaves out empty and blank values, and keeps the others as they are', () => {
    expect(envInput({ A: '', B: '  ', C: '\t\n', D: ' 1 ', E: 'x', F: undefined })).toEqual({ D: ' 1 ', E: 'x' });
  });
});

describe('a switch environment variable', () => {
  it('reads true / 1 and false / 0, and keeps a named mode as its name', () => {
    const flag = envFlag('during-run');
    expect(['true', '1', 'false', '0', 'during-run'].map((value) => flag.parse(value))).toEqual([true, true, false, false, 'during-run']);
    expect(envFlag().parse('0')).toBe(false);
  });

  it('refuses anything else, listing what it takes', () => {
    const parsed = envFlag('after-prefills').safeParse('yes');
    expect(parsed.success).toBe(false);
    for (const option of ['true', 'false', '1', '0', 'after-prefills']) expect(parsed.error?.issues[0]?.message).toContain(`"${option}"`);
    expect(envFlag().safeParse('during-run').success).toBe(false);
  });

  it('takes its default as the value it reads to', () => {
    expect(envFlag().default(false).parse(undefined)).toBe(false);
    expect(envFlag('during-run').default('during-run').parse(undefined)).toBe('during-run');
  });
});
