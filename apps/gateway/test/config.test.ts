import { describe, expect, it } from 'vitest';
import { ConfigError, loadGatewayConfig } from '../src/config.js';

describe('gateway configuration', () => {
  it('has defaults for everything', () => {
    const config = loadGatewayConfig({});
    expect(config).toMatchObject({
      port: 8080,
      redisUrl: 'redis://127.0.0.1:6379',
      heartbeatMs: 15_000,
      headersWaitMs: 0,
      streamIntervalMs: 0,
    });
    expect(config.gatewayId).toMatch(/^[\w.-]+$/);
  });

  it('names every invalid variable', () => {
    expect(() => loadGatewayConfig({ PORT: 'eighty', REDIS_URL: 'http://x', HEARTBEAT_MS: '-1' })).toThrow(ConfigError);
    try {
      loadGatewayConfig({ PORT: 'eighty', REDIS_URL: 'http://x', HEARTBEAT_MS: '-1' });
    } catch (error) {
      expect(String(error)).toMatch(/PORT/);
      expect(String(error)).toMatch(/REDIS_URL/);
      expect(String(error)).toMatch(/HEARTBEAT_MS/);
    }
  });

  it('treats empty strings as unset', () => {
    expect(loadGatewayConfig({ PORT: '' }).port).toBe(8080);
  });
});
