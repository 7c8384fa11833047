import { closeSync, fstatSync, openSync } from 'node:fs';
import { basename } from 'node:path';
import { FileReader, WIRE, type Field } from './protobuf-file-reader.js';

/** Initializers with at least this many bytes of `raw_data` are left in the file, not read. */
export const GRAPH_ONLY_MIN_BYTES = 1024;

/** Field numbers from onnx.proto. */
const MODEL_GRAPH = 7;
const GRAPH_NODE = 1;
const GRAPH_INITIALIZER = 5;
const NODE = { input: 1, opType: 4, attribute: 5 } as const;
const ATTRIBUTE = { g: 6, graphs: 11 } as const;
const TENSOR = { name: 8, rawData: 9, externalData: 13, dataLocation: 14 } as const;
const ENTRY = { key: 1, value: 2 } as const;
const EXTERNAL = 1;

/**
 * An ONNX model file re-encoded without its weights: every initializer whose `raw_data` holds
 * {@link GRAPH_ONLY_MIN_BYTES} or more becomes external data naming the model file itself (its base
 * name, so relative to the file's folder) at the offset where those bytes lie, and nothing else
 * changes, field for field and in order. A runtime that reads external data relative to that folder
 * loads the same model from it; a caller that decodes it holds the graph, not the weights (the
 * weights are skipped by seeking, as `readOnnxIo` does). Initializers already in external-data files
 * and those held in typed fields (`float_data`, ...) are copied as they are, and so are the tables a
 * Gather reads (embeddings, in any subgraph too): onnxruntime maps external data from the file and
 * copies only what it prepacks, so such a table would stay a file mapping that every token reads — the
 * tied lm_head's weight among them — and the bench model's batch-1 call ran ~5 % slower so
 * (docs/engine.md, "Inline weights read in place").
 */
export function readOnnxGraphOnly(onnxPath: string): Uint8Array {
  const fd = openSync(onnxPath, 'r');
  try {
    const reader = new FileReader(fd, fstatSync(fd).size, onnxPath);
    const location = basename(onnxPath);
    const parts: Uint8Array[] = [];
    for (const field of reader.fields(0, reader.size)) {
      if (field.number === MODEL_GRAPH && field.wireType === WIRE.bytes) {
        const gathered = new Set<string>();
        gatheredTables(reader, field, gathered);
        parts.push(lengthDelimited(MODEL_GRAPH, graphOnly(reader, field, location, gathered)));
      } else {
        parts.push(copy(reader, field));
      }
    }
    return concat(parts);
  } finally {
    closeSync(fd);
  }
}

/** The names of the tensors Gather nodes read their rows from (input 0), in `graph` and its subgraphs. */
function gatheredTables(reader: FileReader, graph: Field, into: Set<string>): void {
  for (const node of reader.fields(graph.start, graph.end)) {
    if (node.number !== GRAPH_NODE || node.wireType !== WIRE.bytes) continue;
    let opType = '';
    let data: string | undefined;
    for (const field of reader.fields(node.start, node.end)) {
      if (field.wireType !== WIRE.bytes) continue;
      if (field.number === NODE.opType) opType = reader.string(field);
      else if (field.number === NODE.input) data ??= reader.string(field);
      else if (field.number === NODE.attribute) {
        for (const attribute of reader.fields(field.start, field.end)) {
          if (attribute.wireType === WIRE.bytes && (attribute.number === ATTRIBUTE.g || attribute.number === ATTRIBUTE.graphs))
            gatheredTables(reader, attribute, into);
        }
      }
    }
    if (opType === 'Gather' && data !== undefined) into.add(data);
  }
}

function graphOnly(reader: FileReader, graph: Field, location: string, gathered: ReadonlySet<string>): Uint8Array {
  const parts: Uint8Array[] = [];
  for (const field of reader.fields(graph.start, graph.end)) {
    parts.push(
      field.number === GRAPH_INITIALIZER && field.wireType === WIRE.bytes
        ? lengthDelimited(GRAPH_INITIALIZER, tensorOnly(reader, field, location, gathered))
        : copy(reader, field),
    );
  }
  return concat(parts);
}

/** A TensorProto without its large `raw_data`, naming where those bytes lie instead (unless a Gather reads it). */
function tensorOnly(reader: FileReader, tensor: Field, location: string, gathered: ReadonlySet<string>): Uint8Array {
  const fields = [...reader.fields(tensor.start, tensor.end)];
  const nameField = fields.find((field) => field.number === TENSOR.name && field.wireType === WIRE.bytes);
  if (nameField !== undefined && gathered.has(reader.string(nameField))) return concat(fields.map((field) => copy(reader, field)));
  const parts: Uint8Array[] = [];
  let left: { offset: number; length: number } | undefined;
  for (const field of fields) {
    if (field.number === TENSOR.rawData && field.wireType === WIRE.bytes && field.end - field.start >= GRAPH_ONLY_MIN_BYTES) {
      left = { offset: field.start, length: field.end - field.start };
    } else {
      parts.push(copy(reader, field));
    }
  }
  if (left === undefined) return concat(parts);
  const entry = (key: string, value: string): Uint8Array =>
    lengthDelimited(TENSOR.externalData, concat([lengthDelimited(ENTRY.key, utf8(key)), lengthDelimited(ENTRY.value, utf8(value))]));
  parts.push(
    entry('location', location),
    entry('offset', String(left.offset)),
    entry('length', String(left.length)),
    concat([varint(TENSOR.dataLocation * 8 + WIRE.varint), varint(EXTERNAL)]),
  );
  return concat(parts);
}

/** A field exactly as it lies in the file (its key included). */
function copy(reader: FileReader, field: Field): Uint8Array {
  return reader.bytes(field.at, field.end - field.at).slice();
}

function lengthDelimited(number: number, payload: Uint8Array): Uint8Array {
  return concat([varint(number * 8 + WIRE.bytes), varint(payload.length), payload]);
}

function varint(value: number): Uint8Array {
  const bytes: number[] = [];
  let rest = value;
  while (rest >= 0x80) {
    bytes.push((rest % 0x80) | 0x80);
    rest = Math.floor(rest / 0x80);
  }
  bytes.push(rest);
  return Uint8Array.from(bytes);
}

const encoder = new TextEncoder();
function utf8(text: string): Uint8Array {
  return encoder.encode(text);
}

function concat(parts: readonly Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((sum, part) => sum + part.length, 0));
  let at = 0;
  for (const part of parts) {
    out.set(part, at);
    at += part.length;
  }
  return out;
}
