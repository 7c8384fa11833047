import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { hasPromtool, promtool } from './support/prometheus-server.js';

/**
 * The shipped rules, checked by promtool: they load, and each alert fires (or stays quiet) on made-up
 * series for the cases in prometheus-alert-rules.promtool.yml: idle, a total outage whose requests are
 * all refused before any work, a redeploy's drain, a single 503 at low traffic, gateways down.
 * prometheus-dashboard.test.ts runs the same rules on a real Prometheus against a real gateway.
 */

const here = fileURLToPath(new URL('.', import.meta.url));
const deploy = (path: string) => fileURLToPath(new URL(`../deploy/prometheus/${path}`, import.meta.url));

describe.skipIf(!hasPromtool())('deploy/prometheus rules under promtool', () => {
  it('passes promtool check config and check rules', () => {
    const config = promtool(['check', 'config', deploy('prometheus.yml')]);
    expect(config.status, config.output).toBe(0);
    const rules = promtool(['check', 'rules', deploy('alerts.yml')]);
    expect(rules.status, rules.output).toBe(0);
  });

  it('fires each alert on its cases and on nothing else', () => {
    const result = promtool(['test', 'rules', 'prometheus-alert-rules.promtool.yml'], here);
    expect(result.status, result.output).toBe(0);
    expect(result.output).toContain('SUCCESS');
  });
});
