import { describe, expect, it } from 'vitest';
import { ConfigError, gatewayEnvSchema, loadGatewayConfig } from '../src/config.js';

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

  it('treats blank (whitespace-only) values as unset, like empty ones', () => {
    expect(loadGatewayConfig({ PORT: ' ', HEARTBEAT_MS: '\t' })).toMatchObject({ port: 8080, heartbeatMs: 15_000 });
  });

  it('accepts only plain decimal integers, and names the variable that is not one', () => {
    expect(loadGatewayConfig({ PORT: ' 9090 ' }).port).toBe(9090);
    for (const value of ['0x1F90', '1e3', '8080.0', '8_080', '+80', 'Infinity']) {
      expect(() => loadGatewayConfig({ PORT: value }), value).toThrow(/PORT: must be a decimal integer/);
    }
    expect(() => loadGatewayConfig({ MAX_BODY_BYTES: '1e6' })).toThrow(/MAX_BODY_BYTES: must be a decimal integer/);
  });

  it('refuses a millisecond setting beyond the longest timer Node can run, naming the variable and the maximum', () => {
    const msVariables = [
      'HEADERS_WAIT_MS',
      'HEARTBEAT_MS',
      'STREAM_INTERVAL_MS',
      'CLIENT_STALL_TIMEOUT_MS',
      'QUEUE_TIMEOUT_MS',
      'IDLE_TIMEOUT_MS',
      'REQUEST_TIMEOUT_MS',
      'DRAIN_TIMEOUT_MS',
      'DRAIN_DELAY_MS',
      'FINAL_SCRAPE_MAX_MS',
      'REGISTRY_POLL_MS',
      'STREAM_RETENTION_MS',
      'RESUME_GRACE_MS',
      'MAX_RESUME_GRACE_MS',
      'HEADERS_TIMEOUT_MS',
      'HTTP_REQUEST_TIMEOUT_MS',
      'KEEP_ALIVE_TIMEOUT_MS',
    ];
    // Every *_MS variable of the schema is in the list.
    expect(Object.keys(gatewayEnvSchema.shape).filter((name) => name.endsWith('_MS'))).toEqual(expect.arrayContaining(msVariables));
    expect(msVariables).toEqual(expect.arrayContaining(Object.keys(gatewayEnvSchema.shape).filter((name) => name.endsWith('_MS'))));
    for (const name of msVariables) {
      expect(loadGatewayConfig({ [name]: '2147483647' }), name).toBeDefined();
      expect(() => loadGatewayConfig({ [name]: '3000000000' }), name).toThrow(new RegExp(`${name}: must be at most 2147483647`));
    }
  });
});
