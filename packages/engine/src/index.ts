export type * from './types.js';
export { createEngine } from './create-engine.js';
export { EngineError } from './engine-error.js';
