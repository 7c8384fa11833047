/**
 * Entry of the engine thread: loads the model, then runs steps while there is work. session.run()
 * blocks the thread it runs on for the whole step, which is why this is not the host thread.
 */
import { parentPort, receiveMessageOnPort, workerData, type MessagePort } from 'node:worker_threads';
import { stat } from 'node:fs/promises';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { loadModelDir, type ModelDir } from '@sluice/model';
import { EngineCore } from './engine-core.js';
import { EngineError } from './engine-error.js';
import type { EngineThreadData, HostMessage, ThreadMessage } from './engine-protocol.js';
import { OnnxSession } from './onnx-session.js';
import { physicalCores } from './physical-cores.js';

const DEFAULT_MAX_BATCH_SIZE = 32;
const DEFAULT_MAX_STEP_TOKENS = 512;
const DEFAULT_MAX_PREFILL_BATCH = 32;

/**
 * The fixed cost of one decode call in KV slots of batch work. A CPU decode call reads every weight
 * once (fixed) and moves the batch's KV cache several times (concat past + new, the attention
 * reads, the copy of present.* out of onnxruntime): about 12 × the slot's bytes. Measured on the
 * bench model: ~8 ms per call and ~0.015 ms per padded slot, a ratio of ~530 slots; this estimate
 * gives ~520.
 */
async function estimateLaneCost(model: ModelDir, session: OnnxSession): Promise<number> {
  const files = [model.onnxPath, ...model.onnxDataPaths];
  let weightBytes = 0;
  for (const file of files) weightBytes += (await stat(file)).size;
  const { numLayers, numKvHeads, headDim, dtype } = session.io.kv;
  const slotBytes = 2 * numLayers * numKvHeads * headDim * (dtype === 'float16' ? 2 : 4);
  return Math.max(1, Math.round(weightBytes / (slotBytes * 12)));
}

async function main(port: MessagePort, { options }: EngineThreadData): Promise<void> {
  const post = (message: ThreadMessage): void => port.postMessage(message);
  let session: OnnxSession;
  let core: EngineCore;
  try {
    const model = await loadModelDir(options.modelDir);
    const intraOpThreads = options.intraOpThreads || physicalCores();
    session = await OnnxSession.create({
      modelPath: model.onnxPath,
      executionProvider: options.executionProvider ?? 'cpu',
      intraOpThreads,
      interOpThreads: options.interOpThreads ?? 0,
      intraOpSpinning: options.intraOpSpinning ?? true,
      gqaAttention: options.gqaAttention ?? 'decomposed',
      weightsInPlace: options.weightsInPlace ?? false,
    });
    // What the served graph runs: the rewrite may have replaced the model's GroupQueryAttention.
    const groupQueryAttention = !model.io.usesGroupQueryAttention ? 'none' : session.groupQueryAttention === false ? 'decomposed' : 'op';
    const maxBatchSize = options.maxBatchSize ?? DEFAULT_MAX_BATCH_SIZE;
    const maxCachedTokens = options.maxCachedTokens ?? maxBatchSize * model.generation.maxContextLength;
    // A sequence never holds more than the whole cache: that is the context a request can have here
    // (what the worker advertises, what a default max_tokens fills), not the model's.
    const maxContextLength = Math.min(model.generation.maxContextLength, maxCachedTokens);
    const limits = {
      maxBatchSize,
      maxStepTokens: options.maxStepTokens ?? DEFAULT_MAX_STEP_TOKENS,
      maxCachedTokens,
      laneCost: await estimateLaneCost(model, session),
      exactLengthBatches: groupQueryAttention === 'op',
      continuationMode: options.continuationMode ?? 'replay',
      kvGrowth: options.kvGrowth ?? 'in-place',
      kvPreallocate: options.kvPreallocate ?? false,
      maxPrefillBatch: options.maxPrefillBatch ?? DEFAULT_MAX_PREFILL_BATCH,
      earlyFirstTokens: options.earlyFirstTokens ?? true,
    };
    core = new EngineCore(session, model, limits);
    post({
      type: 'ready',
      info: {
        modelId: model.id,
        maxContextLength,
        maxBatchSize,
        maxCachedTokens,
        executionProvider: options.executionProvider ?? 'cpu',
        kvReservedBytes: core.kvReservedBytes,
        intraOpThreads,
        kvCache: session.outputsNewKv ? 'engine-owned' : 'present',
        groupQueryAttention,
        splitAttentionLayers: session.splitAttentionLayers,
      },
      vocabSize: session.io.vocabSize ?? model.tokenizer.vocabSize,
      maxCachedTokens: limits.maxCachedTokens,
    });
  } catch (cause) {
    const error = cause instanceof EngineError ? cause : undefined;
    post({
      type: 'init-error',
      code: error?.code ?? 'internal',
      message: error?.message ?? `Could not start the engine: ${cause instanceof Error ? cause.message : String(cause)}`,
    });
    return;
  }

  let closing = false;
  let wake: (() => void) | undefined;
  const handle = (message: HostMessage): void => {
    if (message.type === 'add') core.add(message.key, message.request, message.submittedAt);
    else if (message.type === 'abort') core.abort(message.key);
    else closing = true;
  };
  port.on('message', (message: HostMessage) => {
    handle(message);
    wake?.();
  });
  // Messages that arrived during a step are taken synchronously at the boundary, so an abort or a
  // newcomer counts at the very next step rather than one later.
  const drain = (): void => {
    for (let received = receiveMessageOnPort(port); received !== undefined; received = receiveMessageOnPort(port)) {
      handle(received.message as HostMessage);
    }
  };

  // Timer-based: how late this thread's loop gets to anything (messages included) between steps.
  const loopDelay = monitorEventLoopDelay({ resolution: 10 });
  loopDelay.enable();
  for (;;) {
    drain();
    if (closing) break;
    if (core.idle) {
      // Its timer would wake an idle thread 100 times a second for nothing to measure.
      loopDelay.disable();
      await new Promise<void>((resolve) => (wake = resolve));
      wake = undefined;
      loopDelay.reset();
      loopDelay.enable();
      continue;
    }
    try {
      const { events, stats } = await core.step((early) => post({ type: 'step', events: early }));
      if (stats !== undefined) {
        stats.eventLoopLagMs = loopDelay.max / 1e6;
        loopDelay.reset();
      }
      if (events.length > 0 || stats !== undefined) {
        post(stats === undefined ? { type: 'step', events } : { type: 'step', events, stats });
      }
    } catch (cause) {
      const { events } = core.failAll('internal', `Engine step failed: ${cause instanceof Error ? cause.message : String(cause)}`);
      post({ type: 'step', events });
    }
  }
  loopDelay.disable();
  const { events } = core.failAll('engine_closed', 'The engine was closed.');
  if (events.length > 0) post({ type: 'step', events });
  try {
    await session.dispose();
  } finally {
    post({ type: 'closed' });
    port.close();
  }
}

if (parentPort === null) throw new Error('engine-thread must run in a worker thread');
await main(parentPort, workerData as EngineThreadData);
