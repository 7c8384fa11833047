/**
 * A small, fast, seedable generator (xoshiro128**, seeded through splitmix32). Every sequence owns
 * one, so a seeded request draws the same numbers whatever else shares its batch; `Math.random`
 * would interleave draws across requests.
 */
export class SeededRandom {
  readonly #state = new Uint32Array(4);

  /**
   * @param seed any safe integer (negative and > 2^32 values are folded, not truncated)
   * @param stream distinguishes generators that share a seed (the sibling index of an n > 1 request)
   * @param counter distinguishes generators of one stream (the token position: {@link PositionedRandom})
   */
  constructor(seed: number, stream = 0, counter = 0) {
    const low = seed >>> 0;
    const high = Math.floor(seed / 0x1_0000_0000) >>> 0;
    let mix = splitmix32(low ^ splitmix32(high ^ 0x9e37_79b9) ^ Math.imul(stream + 1, 0x85eb_ca6b));
    if (counter !== 0) mix = splitmix32(mix ^ splitmix32((counter >>> 0) ^ 0x27d4_eb2f) ^ Math.floor(counter / 0x1_0000_0000));
    for (let i = 0; i < 4; i++) {
      mix = splitmix32(mix + i);
      this.#state[i] = mix;
    }
    if ((this.#state[0]! | this.#state[1]! | this.#state[2]! | this.#state[3]!) === 0) this.#state[0] = 1;
  }

  /** Next 32 random bits. */
  nextUint32(): number {
    const s = this.#state;
    const s0 = s[0]!;
    const s1 = s[1]!;
    const s2 = s[2]!;
    const s3 = s[3]!;
    const result = Math.imul(rotl(Math.imul(s1, 5), 7), 9) >>> 0;
    const t = s1 << 9;
    const n2 = s2 ^ s0;
    const n3 = s3 ^ s1;
    s[1] = s1 ^ n2;
    s[0] = s0 ^ n3;
    s[2] = n2 ^ t;
    s[3] = rotl(n3, 11);
    return result;
  }

  /** A double in [0, 1) with 53 random bits. */
  next(): number {
    const high = this.nextUint32() >>> 5; // 27 bits
    const low = this.nextUint32() >>> 6; // 26 bits
    return (high * 67_108_864 + low) / 9_007_199_254_740_992;
  }
}

function rotl(x: number, k: number): number {
  return (x << k) | (x >>> (32 - k));
}

function splitmix32(value: number): number {
  let z = (value + 0x9e37_79b9) | 0;
  z = Math.imul(z ^ (z >>> 16), 0x85eb_ca6b);
  z = Math.imul(z ^ (z >>> 13), 0xc2b2_ae35);
  return (z ^ (z >>> 16)) >>> 0;
}

/**
 * The draws of one choice, one per token position, each from a generator keyed by (seed, choice,
 * position) — counter-based: a continuation on another worker starts at any position without
 * replaying the draws before it, and gets the numbers the original run would have drawn.
 */
export class PositionedRandom {
  readonly #seed: number;
  readonly #stream: number;
  #position: number;

  constructor(seed: number, stream = 0, position = 0) {
    this.#seed = seed;
    this.#stream = stream;
    this.#position = position;
  }

  /** The draw of the next token position, a double in [0, 1). */
  next(): number {
    return new SeededRandom(this.#seed, this.#stream, this.#position++).next();
  }

  /** Moves past `count` positions whose tokens are already known (a continuation's generated tokens). */
  skip(count: number): void {
    this.#position += count;
  }
}
