import { createRequire } from 'node:module';
import onnxProto from 'onnx-proto';
import { describe, expect, it } from 'vitest';
import { exactOnnxInt64 } from '../src/onnx-proto.js';

const { onnx } = onnxProto;

describe('exactOnnxInt64', () => {
  it('encodes INT64_MAX exactly where protobufjs found no `long` (a production install without dev dependencies)', () => {
    // onnx-proto's protobufjs, as a pruned tree leaves it: no 64-bit integer class.
    const protobuf = createRequire(createRequire(import.meta.url).resolve('onnx-proto'))('protobufjs/minimal') as {
      util: { Long: unknown };
      configure(): void;
    };
    protobuf.util.Long = null;
    protobuf.configure();
    exactOnnxInt64();
    const tensor = onnx.TensorProto.create({ dims: [1], dataType: onnx.TensorProto.DataType.INT64, int64Data: ['9223372036854775807'] });
    const back = onnx.TensorProto.decode(onnx.TensorProto.encode(tensor).finish());
    // Without it: -9223372036854775808 (the Slice that keeps the last position then kept nothing).
    expect(String(back.int64Data[0])).toBe('9223372036854775807');
  });
});
