import onnxProto from 'onnx-proto';
import { exactOnnxInt64 } from '../onnx-proto.js';

const { onnx } = onnxProto;

/** Initializers smaller than this stay in the graph file (onnx's `convert_model_to_external_data` default). */
export const EXTERNAL_DATA_MIN_BYTES = 1024;

/**
 * Moves a model's large initializers into one external-data file, as exporters do for models past
 * protobuf's 2 GB limit (Optimum, onnxruntime-genai: `model.onnx` + `model.onnx_data`): each moved
 * tensor keeps its name, type and dims and names `location`, its byte offset and length instead of
 * holding `raw_data`. Tensors are laid out back to back in graph order, so the same model gives the
 * same bytes. `location` is relative to the graph file's folder.
 */
export function withExternalData(model: Uint8Array, location: string): { onnx: Uint8Array; data: Uint8Array } {
  exactOnnxInt64();
  const decoded = onnx.ModelProto.decode(model);
  const chunks: Uint8Array[] = [];
  let offset = 0;
  for (const tensor of decoded.graph?.initializer ?? []) {
    const raw = tensor.rawData;
    if (raw == null || raw.length < EXTERNAL_DATA_MIN_BYTES) continue;
    tensor.externalData = [
      { key: 'location', value: location },
      { key: 'offset', value: String(offset) },
      { key: 'length', value: String(raw.length) },
    ];
    tensor.dataLocation = onnx.TensorProto.DataLocation.EXTERNAL;
    tensor.rawData = new Uint8Array(0);
    chunks.push(raw);
    offset += raw.length;
  }
  const data = new Uint8Array(offset);
  let at = 0;
  for (const chunk of chunks) {
    data.set(chunk, at);
    at += chunk.length;
  }
  return { onnx: onnx.ModelProto.encode(decoded).finish(), data };
}
