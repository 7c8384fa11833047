/**
 * A worker process with the fake engine: the real worker wiring (BullMQ, publisher, cancels,
 * registry) from `apps/worker/dist`, no model. Run with `node --import tsx test/support/fake-worker.ts`.
 * Env: the worker's own variables, plus FAKE_STEP_MS (default 5).
 */
import { pino } from 'pino';
import { loadWorkerConfig } from '../../apps/worker/dist/config.js';
import { startWorker } from '../../apps/worker/dist/worker.js';
import { byteLevelTokenizerJson } from '../../packages/model/test/fixtures/byte-level-tokenizer.js';
import { createFakeEngine } from './fake-engine.js';

const config = loadWorkerConfig();
const logger = pino({ name: 'fake-worker', level: config.logLevel });
const engine = createFakeEngine({
  stepMs: Number(process.env.FAKE_STEP_MS ?? 5),
  maxBatchSize: config.maxBatchSize,
  modelId: config.modelId ?? 'fake',
});
// Gateways tokenize with this card: a small byte-level BPE tokenizer and a ChatML template.
const modelCard = {
  tokenizerJson: JSON.stringify(byteLevelTokenizerJson()),
  tokenizerConfigJson: '{}',
  chatTemplate:
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}" +
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
  maxContextLength: engine.info.maxContextLength,
};
const worker = await startWorker(config, { engine, modelCard, modelId: engine.info.modelId, logger });
const stop = () => void worker.drain().then(() => process.exit(0));
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
