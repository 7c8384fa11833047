import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    // `npm run stress` (SLUICE_STRESS=1): the fault-injection loops of test/stress instead.
    include:
      process.env.SLUICE_STRESS === '1'
        ? ['test/stress/**/*.stress.ts']
        : ['packages/*/test/**/*.test.ts', 'apps/*/test/**/*.test.ts', 'test/**/*.test.ts'],
    pool: 'forks',
    testTimeout: process.env.SLUICE_STRESS === '1' ? 3_600_000 : 120_000,
    hookTimeout: 180_000,
    fileParallelism: false,
  },
});
