export * from './names.js';
export * from './job.js';
export * from './wire-error.js';
export * from './gateway-message.js';
export * from './control-message.js';
export * from './request-meta.js';
export * from './token-log.js';
export * from './worker-record.js';
