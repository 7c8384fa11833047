import onnxProto from 'onnx-proto';

const { onnx } = onnxProto;

/**
 * Makes `tensor` external data: its `raw_data` (dropped here) is read from `location` (relative to the
 * graph file's folder) at `offset`, as many bytes as it held. The tensor keeps its name, type and dims.
 */
export function referExternalData(tensor: onnxProto.onnx.ITensorProto, location: string, offset: number): void {
  const length = tensor.rawData?.length ?? 0;
  tensor.externalData = [
    { key: 'location', value: location },
    { key: 'offset', value: String(offset) },
    { key: 'length', value: String(length) },
  ];
  tensor.dataLocation = onnx.TensorProto.DataLocation.EXTERNAL;
  tensor.rawData = new Uint8Array(0);
}
