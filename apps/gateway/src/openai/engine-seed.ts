import { z } from 'zod';

/** The top of int64 as JSON.parse reads it: 9223372036854775807 (2^63 - 1) rounds up to 2^63. */
const INT64_LIMIT = 2 ** 63;

/**
 * OpenAI's `seed`, an int64, as `JSON.parse` reads it: a double. Above 2^53 a double cannot hold every
 * integer, so what arrives is the int64 rounded to the nearest double; int64's max, which some clients
 * send, arrives as 2^63 and is taken as the top of the range (a decimal just past int64's max rounds
 * to the same double, and is taken too: nothing tells the two apart after the parse).
 */
export const seedSchema = z
  .number()
  .refine(Number.isInteger, 'must be an integer.')
  .refine(
    (seed) => seed >= -INT64_LIMIT && seed <= INT64_LIMIT,
    'must be a 64-bit signed integer (from -9223372036854775808 to 9223372036854775807).',
  )
  .meta({ type: 'integer', format: 'int64' });

/**
 * The seed a job carries: a safe integer, as the job schema, the token log and the engine's generator
 * take it (a job of this gateway then runs on any worker, older ones included).
 *
 * A safe integer crosses unchanged: a seed draws the numbers it drew before. A larger one is hashed
 * (splitmix64 of the double's 64 bits) into [0, 2^53): the same seed always gives the same job seed,
 * and two seeds share one with a chance of 2^-53, where folding the high bits onto the low ones would
 * tie round numbers that clients pick together (2^60 with 0; int64's max, read as 2^63, with its min).
 */
export function engineSeed(seed: number): number {
  if (Number.isSafeInteger(seed)) return seed;
  const bits = new BigUint64Array(new Float64Array([seed]).buffer)[0]!;
  let z = BigInt.asUintN(64, bits + 0x9e37_79b9_7f4a_7c15n);
  z = BigInt.asUintN(64, (z ^ (z >> 30n)) * 0xbf58_476d_1ce4_e5b9n);
  z = BigInt.asUintN(64, (z ^ (z >> 27n)) * 0x94d0_49bb_1331_11ebn);
  z ^= z >> 31n;
  return Number(z >> 11n);
}
