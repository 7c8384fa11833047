import { z } from 'zod';

/**
 * How the gateway and the worker read their environment variables: the same rules in both, so that
 * one value means the same thing to either process.
 */

/** Node runs a timer set above this as a 1 ms timer (TimeoutOverflowWarning): the cap of every `*_MS` variable. */
export const MAX_TIMER_MS = 2_147_483_647;

/** The variables of `env` that are set: empty and blank (whitespace-only) values count as unset. */
export function envInput(env: NodeJS.ProcessEnv): Record<string, string> {
  return Object.fromEntries(
    Object.entries(env).filter((entry): entry is [string, string] => entry[1] !== undefined && entry[1].trim() !== ''),
  );
}

/** An integer variable: plain decimal digits only (no `0x1F90`, `1e6`, `8080.0`), from `min` to `max`. */
export const envInt = (min: number, max = Number.MAX_SAFE_INTEGER, tooLarge = `must be at most ${max}`) =>
  z
    .string()
    .trim()
    .regex(/^-?\d+$/, 'must be a decimal integer')
    .transform(Number)
    .pipe(z.number().int().min(min, `must be at least ${min}`).max(max, tooLarge));

/** A duration in milliseconds: an integer from `min` to MAX_TIMER_MS. */
export const envMs = (min: number) =>
  envInt(min, MAX_TIMER_MS, `must be at most ${MAX_TIMER_MS} (ms, about 24.8 days: Node's longest timer)`);

/**
 * A switch: `true` / `1` or `false` / `0`, or one of `modes` (kept as its name). Values outside them
 * are refused with the list.
 */
export const envFlag = <const M extends string[]>(...modes: M) =>
  z
    .enum(['true', 'false', '1', '0', ...modes])
    .transform((v): boolean | M[number] => (v === 'true' || v === '1' ? true : v === 'false' || v === '0' ? false : v));
