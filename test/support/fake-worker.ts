/**
 * A worker process with the fake engine: the real worker wiring (BullMQ, publisher, cancels,
 * registry) from `apps/worker/dist`, no model. Run with `node --import tsx test/support/fake-worker.ts`.
 * Env: the worker's own variables, plus FAKE_STEP_MS (default 5).
 */
import { pino } from 'pino';
import { loadWorkerConfig } from '../../apps/worker/dist/config.js';
import { startWorker } from '../../apps/worker/dist/worker.js';
import { createFakeEngine } from './fake-engine.js';

const config = loadWorkerConfig();
const logger = pino({ name: 'fake-worker', level: config.logLevel });
const engine = createFakeEngine({
  stepMs: Number(process.env.FAKE_STEP_MS ?? 5),
  maxBatchSize: config.maxBatchSize,
  modelId: config.modelId ?? 'fake',
});
const prompts = {
  chat: (messages: ReadonlyArray<{ content: string }>) => [...messages.map((m) => m.content).join('\n')].map((ch) => ch.charCodeAt(0) % 512),
  text: (prompt: string) => [...prompt].map((ch) => ch.charCodeAt(0) % 512),
};
const worker = await startWorker(config, { engine, prompts, modelId: engine.info.modelId, logger });
const stop = () => void worker.drain().then(() => process.exit(0));
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
