import { pino } from 'pino';
import { createGatewayMetrics } from '@sluice/metrics';
import { redactRedisUrl, stopOnSignals } from '@sluice/protocol';
import { AccessConfigError } from './auth/access-config-error.js';
import { ConfigError, loadGatewayConfig } from './config.js';
import { ListenError, RedisConnectError, startGateway } from './gateway.js';
import { createGatewayObserver } from './gateway-observer.js';

/** Entry point: config → serve → drain on SIGTERM/SIGINT. */
async function main(): Promise<void> {
  let config;
  try {
    config = loadGatewayConfig();
  } catch (error) {
    if (error instanceof ConfigError) {
      process.stderr.write(`${error.message}\n`);
      process.exit(1);
    }
    throw error;
  }
  const logger = pino({ name: 'gateway', level: config.logLevel });
  let gateway;
  try {
    const metrics = createGatewayMetrics(undefined, { maxKeys: config.access.metricsMaxKeys });
    gateway = await startGateway(config, logger, {
      hooks: createGatewayObserver(metrics, logger),
      keyUsage: metrics.keyUsage,
      configureApp: (app) =>
        app.get('/metrics', async (c) => c.body(await metrics.scrape(), 200, { 'Content-Type': metrics.registry.contentType })),
      nextScrape: (maxMs) => metrics.nextScrape(maxMs),
    });
    const running = gateway;
    metrics.observeReadiness(() => running.ready());
  } catch (error) {
    if (error instanceof AccessConfigError || error instanceof ListenError || error instanceof RedisConnectError) {
      logger.fatal(error.message);
      process.stderr.write(`${error.message}\n`);
      process.exit(1);
    }
    logger.fatal({ err: error }, `gateway failed to start (REDIS_URL=${redactRedisUrl(config.redisUrl)})`);
    process.exit(1);
  }
  stopOnSignals(logger, () => gateway.drain());
}

await main();
