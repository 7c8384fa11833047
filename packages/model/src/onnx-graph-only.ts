import { closeSync, fstatSync, openSync } from 'node:fs';
import { basename } from 'node:path';
import { ENTRY, GRAPH, MODEL_GRAPH, nodeTree, TENSOR } from './onnx-file-fields.js';
import { FileReader, WIRE, type Field } from './protobuf-file-reader.js';

/** Initializers with at least this many bytes of `raw_data` are left in the file, not read. */
export const GRAPH_ONLY_MIN_BYTES = 1024;

/** TensorProto.DataLocation.EXTERNAL. */
const EXTERNAL = 1;

/** A span of the file still to read: large fields are read once, straight into the result. */
interface FileSpan {
  at: number;
  length: number;
}

/** An encoded message as the pieces it is made of, in order: put together once, at the end ({@link assemble}). */
type Parts = Array<Uint8Array | FileSpan>;

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
    let parts: Parts = [];
    for (const field of reader.fields(0, reader.size)) {
      // (concat, not a spread: a graph is a part per node and initializer field.)
      if (field.number === MODEL_GRAPH && field.wireType === WIRE.bytes)
        parts = parts.concat(lengthDelimited(MODEL_GRAPH, graphOnly(reader, field, location, gatheredTables(reader, field))));
      else parts.push(copy(reader, field));
    }
    return assemble(reader, parts);
  } finally {
    closeSync(fd);
  }
}

/** The names of the tensors Gather nodes read their rows from (input 0), in `graph` and its subgraphs. */
function gatheredTables(reader: FileReader, graph: Field): Set<string> {
  const tables = new Set<string>();
  for (const field of reader.fields(graph.start, graph.end)) {
    if (field.number !== GRAPH.node || field.wireType !== WIRE.bytes) continue;
    for (const node of nodeTree(reader, field)) if (node.opType === 'Gather') tables.add(node.firstInput);
  }
  return tables;
}

function graphOnly(reader: FileReader, graph: Field, location: string, gathered: ReadonlySet<string>): Parts {
  const parts: Parts = [];
  for (const field of reader.fields(graph.start, graph.end)) {
    if (field.number === GRAPH.initializer && field.wireType === WIRE.bytes) {
      parts.push(...lengthDelimited(GRAPH.initializer, tensorOnly(reader, field, location, gathered)));
    } else {
      parts.push(copy(reader, field));
    }
  }
  return parts;
}

/** A TensorProto without its large `raw_data`, naming where those bytes lie instead (unless a Gather reads it). */
function tensorOnly(reader: FileReader, tensor: Field, location: string, gathered: ReadonlySet<string>): Parts {
  const fields = [...reader.fields(tensor.start, tensor.end)];
  const nameField = fields.find((field) => field.number === TENSOR.name && field.wireType === WIRE.bytes);
  if (nameField !== undefined && gathered.has(reader.string(nameField))) return fields.map((field) => copy(reader, field));
  const parts: Parts = [];
  let left: { offset: number; length: number } | undefined;
  for (const field of fields) {
    if (field.number === TENSOR.rawData && field.wireType === WIRE.bytes && field.end - field.start >= GRAPH_ONLY_MIN_BYTES) {
      left = { offset: field.start, length: field.end - field.start };
    } else {
      parts.push(copy(reader, field));
    }
  }
  if (left === undefined) return parts;
  const entry = (key: string, value: string): Parts =>
    lengthDelimited(TENSOR.externalData, [...lengthDelimited(ENTRY.key, [utf8(key)]), ...lengthDelimited(ENTRY.value, [utf8(value)])]);
  parts.push(
    ...entry('location', location),
    ...entry('offset', String(left.offset)),
    ...entry('length', String(left.length)),
    varint(TENSOR.dataLocation * 8 + WIRE.varint),
    varint(EXTERNAL),
  );
  return parts;
}

/**
 * A field exactly as it lies in the file (its key included): a large one as its span, read later into
 * the result; a small one as a view of the reader's buffer, which the reader never writes again (it
 * reads into a new one).
 */
function copy(reader: FileReader, field: Field): Uint8Array | FileSpan {
  const length = field.end - field.at;
  return length > reader.chunkBytes ? { at: field.at, length } : reader.bytes(field.at, length);
}

function lengthDelimited(number: number, payload: Parts): Parts {
  const key: Parts = [varint(number * 8 + WIRE.bytes), varint(payload.reduce((sum, part) => sum + part.length, 0))];
  return key.concat(payload);
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

/** The parts in one buffer, file spans read straight into it. */
function assemble(reader: FileReader, parts: Parts): Uint8Array {
  const out = new Uint8Array(parts.reduce((sum, part) => sum + part.length, 0));
  let at = 0;
  for (const part of parts) {
    if (part instanceof Uint8Array) out.set(part, at);
    else reader.readInto(out.subarray(at, at + part.length), part.at);
    at += part.length;
  }
  return out;
}
