export * from './names.js';
export * from './job.js';
export * from './wire-error.js';
export * from './gateway-message.js';
export * from './cancel-message.js';
export * from './worker-record.js';
