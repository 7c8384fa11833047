import { describe, expect, it } from 'vitest';
import { ConfigError, describeEngineSettings, engineOptions, loadWorkerConfig, workerEnvSchema } from '../src/config.js';

describe('worker configuration', () => {
  it('binds /metrics and /healthz to loopback unless METRICS_HOST says otherwise, and keeps request ids off them', () => {
    expect(loadWorkerConfig({}).metricsHost).toBe('127.0.0.1');
    expect(loadWorkerConfig({}).healthRequestIds).toBe(false);
    expect(loadWorkerConfig({ METRICS_HOST: '0.0.0.0', HEALTH_REQUEST_IDS: 'true' })).toMatchObject({
      metricsHost: '0.0.0.0',
      healthRequestIds: true,
    });
  });

  it('covers the engine batch with the BullMQ concurrency by default', () => {
    expect(loadWorkerConfig({ MAX_BATCH_SIZE: '12' })).toMatchObject({ maxBatchSize: 12, concurrency: 12, modelDir: undefined });
  });

  it('reserves the KV cache at start only when KV_PREALLOCATE says so', () => {
    expect(loadWorkerConfig({}).kvPreallocate).toBe(false);
    expect(loadWorkerConfig({ KV_PREALLOCATE: '1' }).kvPreallocate).toBe(true);
    expect(() => loadWorkerConfig({ KV_PREALLOCATE: 'yes' })).toThrow(/KV_PREALLOCATE/);
  });

  it('lets onnxruntime threads spin only while a call runs unless INTRA_OP_SPINNING says otherwise', () => {
    expect(loadWorkerConfig({}).intraOpSpinning).toBe('during-run');
    expect(loadWorkerConfig({ INTRA_OP_SPINNING: 'false' }).intraOpSpinning).toBe(false);
    expect(loadWorkerConfig({ INTRA_OP_SPINNING: '0' }).intraOpSpinning).toBe(false);
    expect(loadWorkerConfig({ INTRA_OP_SPINNING: 'true' }).intraOpSpinning).toBe(true);
    expect(loadWorkerConfig({ INTRA_OP_SPINNING: 'during-run' }).intraOpSpinning).toBe('during-run');
    expect(() => loadWorkerConfig({ INTRA_OP_SPINNING: 'sometimes' })).toThrow(/INTRA_OP_SPINNING/);
  });

  it("sends a prompt's first token as its prefill call ends unless EARLY_FIRST_TOKENS says otherwise", () => {
    expect(loadWorkerConfig({}).earlyFirstTokens).toBe(true);
    expect(loadWorkerConfig({ EARLY_FIRST_TOKENS: 'false' }).earlyFirstTokens).toBe(false);
    expect(engineOptions(loadWorkerConfig({ EARLY_FIRST_TOKENS: '0' }), '/m')).toMatchObject({ earlyFirstTokens: false });
    expect(engineOptions(loadWorkerConfig({ EARLY_FIRST_TOKENS: 'after-prefills' }), '/m')).toMatchObject({
      earlyFirstTokens: 'after-prefills',
    });
    expect(() => loadWorkerConfig({ EARLY_FIRST_TOKENS: 'maybe' })).toThrow(/EARLY_FIRST_TOKENS/);
  });

  it('prefills up to 32 whole prompts a call unless MAX_PREFILL_BATCH says otherwise', () => {
    expect(loadWorkerConfig({}).maxPrefillBatch).toBe(32);
    expect(loadWorkerConfig({ MAX_PREFILL_BATCH: '1' }).maxPrefillBatch).toBe(1);
    expect(() => loadWorkerConfig({ MAX_PREFILL_BATCH: '0' })).toThrow(/MAX_PREFILL_BATCH/);
  });

  it('hands the engine its settings: the defaults (spinning during a call), and each variable that changes one', () => {
    expect(engineOptions(loadWorkerConfig({}), '/models/m')).toEqual({
      modelDir: '/models/m',
      maxBatchSize: 32,
      maxStepTokens: 512,
      executionProvider: 'cpu',
      intraOpThreads: 0,
      interOpThreads: 0,
      intraOpSpinning: 'during-run',
      continuationMode: 'replay',
      kvGrowth: 'in-place',
      gqaAttention: 'decomposed',
      kvPreallocate: false,
      weightsInPlace: false,
      maxPrefillBatch: 32,
      earlyFirstTokens: true,
    });
    const env = {
      MAX_CACHED_TOKENS: '4096',
      INTRA_OP_THREADS: '1',
      INTRA_OP_SPINNING: '1',
      KV_GROWTH: 'spread',
      CONTINUATION_MODE: 'prefill',
      GQA_ATTENTION: 'op',
      WEIGHTS_IN_PLACE: '1',
    };
    expect(engineOptions(loadWorkerConfig(env), '/m')).toMatchObject({
      maxCachedTokens: 4096,
      intraOpThreads: 1,
      intraOpSpinning: true,
      kvGrowth: 'spread',
      continuationMode: 'prefill',
      gqaAttention: 'op',
      weightsInPlace: true,
    });
  });

  it('names the invalid variable', () => {
    expect(() => loadWorkerConfig({ MAX_BATCH_SIZE: '0' })).toThrow(/MAX_BATCH_SIZE/);
    expect(() => loadWorkerConfig({ EXECUTION_PROVIDER: 'tpu' })).toThrow(/EXECUTION_PROVIDER/);
    expect(() => loadWorkerConfig({ GQA_ATTENTION: 'flash' })).toThrow(/GQA_ATTENTION/);
    expect(() => loadWorkerConfig({ WORKER_TTL_MS: '500', WORKER_HEARTBEAT_MS: '1000' })).toThrow(ConfigError);
  });

  it('refuses a millisecond setting beyond the longest timer Node can run, naming the variable and the maximum', () => {
    const msVariables = [
      'WORKER_HEARTBEAT_MS',
      'WORKER_TTL_MS',
      'STREAM_RETENTION_MS',
      'DRAIN_TIMEOUT_MS',
      'FINAL_SCRAPE_MAX_MS',
      'LOCK_DURATION_MS',
    ];
    expect(Object.keys(workerEnvSchema.shape).filter((name) => name.endsWith('_MS'))).toEqual(msVariables);
    for (const name of msVariables) {
      expect(() => loadWorkerConfig({ [name]: '3000000000' }), name).toThrow(new RegExp(`${name}: must be at most 2147483647`));
    }
    // The largest value passes (the TTL must still exceed the heartbeat).
    expect(loadWorkerConfig({ WORKER_TTL_MS: '2147483647', LOCK_DURATION_MS: '2147483647' })).toMatchObject({
      ttlMs: 2_147_483_647,
      lockDurationMs: 2_147_483_647,
    });
  });

  it('refuses a step budget below the batch size at start, naming both variables, the value and the bound', () => {
    expect(() => loadWorkerConfig({ MAX_BATCH_SIZE: '8', MAX_STEP_TOKENS: '4' })).toThrow(
      /^invalid worker configuration:\n {2}MAX_STEP_TOKENS: must be at least MAX_BATCH_SIZE \(8\), got 4: /,
    );
    // A batch larger than the default budget: the message says the 512 is the default.
    expect(() => loadWorkerConfig({ MAX_BATCH_SIZE: '600' })).toThrow(
      /MAX_STEP_TOKENS: must be at least MAX_BATCH_SIZE \(600\), got 512 \(its default\)/,
    );
    expect(loadWorkerConfig({ MAX_BATCH_SIZE: '64', MAX_STEP_TOKENS: '64' })).toMatchObject({ maxBatchSize: 64, maxStepTokens: 64 });
  });

  it('names every conflict at once', () => {
    const env = { MAX_STEP_TOKENS: '8', WORKER_TTL_MS: '500', WORKER_HEARTBEAT_MS: '1000' };
    expect(() => loadWorkerConfig(env)).toThrow(ConfigError);
    expect(() => loadWorkerConfig(env)).toThrow(/WORKER_TTL_MS: must be greater than WORKER_HEARTBEAT_MS\n {2}MAX_STEP_TOKENS: /);
  });

  it('names the engine settings and the model context length behind an engine that did not start', () => {
    const settings = describeEngineSettings(loadWorkerConfig({ MAX_BATCH_SIZE: '4', KV_PREALLOCATE: '1' }), 2048);
    expect(settings).toContain('MAX_BATCH_SIZE=4, MAX_STEP_TOKENS=512, MAX_CACHED_TOKENS=unset (MAX_BATCH_SIZE × context length = 8192)');
    expect(settings).toContain('KV_PREALLOCATE=true');
    // The load's memory (an engine that ran out of it) depends on this one.
    expect(settings).toContain('WEIGHTS_IN_PLACE=false');
    expect(settings).toMatch(/; the model's context length: 2048$/);
    expect(describeEngineSettings(loadWorkerConfig({ MAX_CACHED_TOKENS: '300' }), 2048)).toContain('MAX_CACHED_TOKENS=300,');
  });

  it('treats blank values as unset and accepts only plain decimal integers', () => {
    expect(loadWorkerConfig({ METRICS_PORT: ' ', MAX_BATCH_SIZE: '  ' })).toMatchObject({ metricsPort: 9464, maxBatchSize: 32 });
    expect(loadWorkerConfig({ MAX_BATCH_SIZE: ' 8 ' }).maxBatchSize).toBe(8);
    for (const value of ['0x10', '1e2', '16.0']) {
      expect(() => loadWorkerConfig({ MAX_BATCH_SIZE: value }), value).toThrow(/MAX_BATCH_SIZE: must be a decimal integer/);
    }
  });
});
