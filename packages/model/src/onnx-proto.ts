import { createRequire } from 'node:module';

interface Protobuf {
  util: { Long: unknown };
  configure(): void;
}

let configured = false;

/**
 * Makes onnx-proto encode and decode 64-bit integers exactly; call it before either. Its protobufjs
 * finds the `long` class through a `require` resolved from the top of node_modules, where only dev
 * dependencies put one: in a production install (`npm prune --omit=dev`, the worker image) it found
 * none, encoded int64 fields through Number, and INT64_MAX (the engine's last-position Slice, Optimum
 * exports' own Slice ends) became -2^63: every prefill failed. It is given onnx-proto's own `long`.
 */
export function exactOnnxInt64(): void {
  if (configured) return;
  configured = true;
  const require = createRequire(createRequire(import.meta.url).resolve('onnx-proto'));
  const protobuf = require('protobufjs/minimal') as Protobuf;
  if (protobuf.util.Long) return;
  protobuf.util.Long = require('long');
  protobuf.configure();
}
