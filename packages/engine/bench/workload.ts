/** The benchmark's request mix: fixed by a seed so every mode and run sees the same requests. */
export interface BenchRequest {
  id: string;
  /** Milliseconds after the run starts. */
  arrivalMs: number;
  promptTokenIds: number[];
  maxTokens: number;
}

export interface WorkloadOptions {
  requests: number;
  minOutput: number;
  maxOutput: number;
  minPrompt: number;
  maxPrompt: number;
  /** Mean gap between arrivals (exponential gaps: a Poisson process). */
  meanGapMs: number;
  vocabSize: number;
  /** Ids the prompts never use (special tokens). */
  reservedIds: number;
  seed: number;
}

/**
 * Output lengths evenly spread over [minOutput, maxOutput] in shuffled order, prompt lengths
 * uniform in [minPrompt, maxPrompt], Poisson arrivals.
 */
export function makeWorkload(options: WorkloadOptions): BenchRequest[] {
  const random = mulberry32(options.seed);
  const outputs = Array.from({ length: options.requests }, (_, i) =>
    Math.round(options.minOutput + ((options.maxOutput - options.minOutput) * i) / Math.max(1, options.requests - 1)),
  );
  for (let i = outputs.length - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [outputs[i], outputs[j]] = [outputs[j]!, outputs[i]!];
  }
  let arrival = 0;
  return outputs.map((maxTokens, i) => {
    const promptLength = options.minPrompt + Math.floor(random() * (options.maxPrompt - options.minPrompt + 1));
    const promptTokenIds = Array.from(
      { length: promptLength },
      () => options.reservedIds + Math.floor(random() * (options.vocabSize - options.reservedIds)),
    );
    const request: BenchRequest = { id: `bench-${i}`, arrivalMs: arrival, promptTokenIds, maxTokens };
    arrival += -Math.log(1 - random()) * options.meanGapMs;
    return request;
  });
}

function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4_294_967_296;
  };
}
