/**
 * A small seeded pseudo-random generator (sfc32, seeded through splitmix32).
 *
 * Only integer arithmetic and exact float conversions are used, so the stream is bit-identical on
 * every platform and Node version: the generated model files depend on nothing but the seed.
 */
export class Prng {
  private a: number;
  private b: number;
  private c: number;
  private d: number;

  constructor(seed: number) {
    let state = seed >>> 0;
    const next = (): number => {
      state = (state + 0x9e3779b9) >>> 0;
      let z = state;
      z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
      z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
      return (z ^ (z >>> 16)) >>> 0;
    };
    this.a = next();
    this.b = next();
    this.c = next();
    this.d = next();
    // Discard the first outputs: sfc32 mixes its state during the first few rounds.
    for (let i = 0; i < 16; i++) this.nextUint32();
  }

  /** A uniformly distributed 32-bit unsigned integer. */
  nextUint32(): number {
    const t = (((this.a + this.b) >>> 0) + this.d) >>> 0;
    this.d = (this.d + 1) >>> 0;
    this.a = this.b ^ (this.b >>> 9);
    this.b = (this.c + (this.c << 3)) >>> 0;
    this.c = ((this.c << 21) | (this.c >>> 11)) >>> 0;
    this.c = (this.c + t) >>> 0;
    return t;
  }

  /** A float in [0, 1) with 32 random bits (exact in float64). */
  nextFloat(): number {
    return this.nextUint32() / 0x1_0000_0000;
  }

  /** A float uniformly distributed in [-1, 1). */
  nextSigned(): number {
    return this.nextFloat() * 2 - 1;
  }

  /** An integer uniformly distributed in [0, n). */
  nextInt(n: number): number {
    return Math.floor(this.nextFloat() * n);
  }

  /**
   * A generator for one named stream (a weight tensor, say): changing or adding one tensor never
   * shifts the numbers of another.
   */
  static forKey(seed: number, key: string): Prng {
    // FNV-1a over the UTF-16 code units of the key.
    let hash = 0x811c9dc5;
    for (let i = 0; i < key.length; i++) {
      hash = Math.imul(hash ^ key.charCodeAt(i), 0x01000193) >>> 0;
    }
    return new Prng((hash ^ Math.imul(seed >>> 0, 0x9e3779b1)) >>> 0);
  }
}
