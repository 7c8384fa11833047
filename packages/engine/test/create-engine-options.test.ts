import { describe, expect, it } from 'vitest';
import { createEngine, type EngineOptions } from '../src/index.js';

describe('createEngine options', () => {
  it.each([
    [{ kvPreallocate: 'yes' }, /EngineOptions\.kvPreallocate must be a boolean, got yes/],
    [{ kvGrowth: 'sideways' }, /EngineOptions\.kvGrowth must be spread or in-place, got sideways/],
    [{ maxBatchSize: 0 }, /maxBatchSize/],
  ])('refuses %o before loading anything, naming the option', async (bad, message) => {
    const options = { modelDir: '/nonexistent', ...bad } as unknown as EngineOptions;
    await expect(createEngine(options)).rejects.toThrow(message);
  });
});
