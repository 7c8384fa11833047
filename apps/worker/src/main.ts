import { pino } from 'pino';
import { createEngine, EngineError } from '@sluice/engine';
import { createWorkerMetrics } from '@sluice/metrics';
import { ensureBuiltinModel, loadModelDir, readPromptFiles } from '@sluice/model';
import { redactRedisUrl, stopOnSignals } from '@sluice/protocol';
import { ConfigError, describeEngineSettings, engineOptions, loadWorkerConfig } from './config.js';
import { StartupError, startupStep } from './startup-error.js';
import { startWorker } from './worker.js';

/** Entry point: config → model → engine → worker; SIGTERM/SIGINT drain and exit 0. */
async function main(): Promise<void> {
  let config;
  try {
    config = loadWorkerConfig();
  } catch (error) {
    if (error instanceof ConfigError) {
      process.stderr.write(`${error.message}\n`);
      process.exit(1);
    }
    throw error;
  }
  const logger = pino({ name: 'worker', level: config.logLevel });
  let worker;
  try {
    const modelDir =
      config.modelDir ?? (await startupStep('cannot generate the built-in model (MODEL_DIR unset)', () => ensureBuiltinModel('tiny')));
    const modelName = config.modelDir === undefined ? 'the built-in model' : `MODEL_DIR=${config.modelDir}`;
    const { model, promptFiles } = await startupStep(`cannot load ${modelName}`, async () => ({
      model: await loadModelDir(modelDir),
      promptFiles: await readPromptFiles(modelDir),
    }));
    const engine = await startupStep(
      (cause) =>
        cause instanceof EngineError && cause.code === 'provider_unavailable'
          ? `cannot start the engine with EXECUTION_PROVIDER=${config.executionProvider}`
          : `cannot start the engine (${describeEngineSettings(config, model.generation.maxContextLength)})`,
      () => createEngine(engineOptions(config, modelDir)),
    );
    // A worker whose engine thread died would take every job only to fail it. It exits at once instead,
    // before its streams end with an error: gateways see a lost worker and continue its requests on
    // another, token-identical, and whatever runs workers starts a new one.
    engine.onDeath((reason) => {
      logger.fatal({ reason }, 'the engine thread died: exiting so that other workers continue its requests');
      process.exit(1);
    });
    const modelId = config.modelId ?? model.id;
    worker = await startupStep('failed to start', () =>
      startWorker(config, {
        engine,
        // Gateways tokenize and render chat templates with these files; this process never does.
        modelCard: { ...promptFiles, maxContextLength: engine.info.maxContextLength },
        modelId,
        logger,
        metrics: createWorkerMetrics(),
      }),
    );
  } catch (error) {
    const failure = error instanceof StartupError ? error : new StartupError('failed to start', error);
    // The JSON log keeps the whole cause; whoever started the worker reads one line on stderr.
    logger.fatal(
      { err: failure.cause },
      `worker failed to start (MODEL_DIR=${config.modelDir ?? 'built-in tiny'}, REDIS_URL=${redactRedisUrl(config.redisUrl)})`,
    );
    process.stderr.write(`${failure.message}\n`);
    process.exit(1);
  }
  stopOnSignals(logger, () => worker.drain());
}

await main();
