import { WIRE, type Field, type FileReader } from './protobuf-file-reader.js';

/** Field numbers from onnx.proto, for reading a model file through a {@link FileReader}. */
export const MODEL_GRAPH = 7;
export const GRAPH = { node: 1, initializer: 5, input: 11, output: 12 } as const;
export const NODE = { input: 1, opType: 4, attribute: 5 } as const;
export const ATTRIBUTE = { g: 6, graphs: 11 } as const;
export const TENSOR = { name: 8, rawData: 9, externalData: 13, dataLocation: 14 } as const;
/** StringStringEntryProto: key 1, value 2. */
export const ENTRY = { key: 1, value: 2 } as const;

/** A node as {@link graphNodes} reads it. */
export interface NodeSummary {
  opType: string;
  /** Its first input ('' when it has none). */
  firstInput: string;
}

/** A NodeProto field (one of a graph's `node`s) and the nodes of its subgraphs (If / Loop branches), read from the file. */
export function* nodeTree(reader: FileReader, node: Field): Generator<NodeSummary> {
  let opType = '';
  let firstInput: string | undefined;
  for (const field of reader.fields(node.start, node.end)) {
    if (field.wireType !== WIRE.bytes) continue;
    if (field.number === NODE.opType) opType = reader.string(field);
    else if (field.number === NODE.input) firstInput ??= reader.string(field);
    else if (field.number === NODE.attribute) {
      for (const attribute of reader.fields(field.start, field.end)) {
        if (attribute.wireType !== WIRE.bytes || (attribute.number !== ATTRIBUTE.g && attribute.number !== ATTRIBUTE.graphs)) continue;
        for (const inner of reader.fields(attribute.start, attribute.end))
          if (inner.number === GRAPH.node && inner.wireType === WIRE.bytes) yield* nodeTree(reader, inner);
      }
    }
  }
  yield { opType, firstInput: firstInput ?? '' };
}
