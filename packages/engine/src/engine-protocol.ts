/**
 * Messages between the host thread ({@link createEngine}) and the engine thread. Plain objects
 * (structured clone); the engine thread sends exactly one `step` message per engine step, so the
 * host delivers all of a step's events in one macrotask.
 */
import type { ResolvedRequest } from './resolve-request.js';
import type { EngineErrorCode, EngineEvent, EngineInfo, EngineOptions, StepStats } from './types.js';

/** `workerData` of the engine thread. */
export interface EngineThreadData {
  options: EngineOptions;
}

export type HostMessage =
  | {
      type: 'add';
      key: number;
      request: ResolvedRequest;
      /** performance.timeOrigin + performance.now() on the host when generate() was called. */
      submittedAt: number;
    }
  | { type: 'abort'; key: number }
  | { type: 'close' };

/** The engine's limits, sent once the model is loaded. */
export interface ThreadReady {
  type: 'ready';
  info: EngineInfo;
  vocabSize: number;
  maxCachedTokens: number;
}

export type ThreadMessage =
  | ThreadReady
  | { type: 'init-error'; code: EngineErrorCode; message: string }
  | {
      type: 'step';
      /** Events of this step, each with the key of its request, in emission order. */
      events: Array<[key: number, event: EngineEvent]>;
      /** Absent when the step ran no model call (it only ended aborted requests). */
      stats?: StepStats;
    }
  | { type: 'closed' };
