/**
 * A GGUF (version 3) file writer: the container llama.cpp loads. Enough of the format for float32
 * models: typed metadata (numbers, booleans, strings and arrays of them) and float32 tensors.
 *
 * Layout: header (magic, version, tensor count, metadata count), the metadata key/value pairs, one
 * info record per tensor (name, dimensions innermost first, type, offset in the data section), padding
 * to the alignment, then each tensor's bytes, each starting on the alignment.
 */

/** A metadata value with its GGUF type. */
export type GgufValue =
  | { type: 'uint32'; value: number }
  | { type: 'int32'; value: number }
  | { type: 'float32'; value: number }
  | { type: 'bool'; value: boolean }
  | { type: 'string'; value: string }
  | { type: 'string[]'; value: readonly string[] }
  | { type: 'int32[]'; value: readonly number[] };

/** A float32 tensor. `shape` is row-major, outermost first (as numpy and PyTorch write it). */
export interface GgufTensor {
  name: string;
  shape: readonly number[];
  data: Float32Array;
}

/** GGUF's value type codes. */
const TYPE = { uint32: 4, int32: 5, float32: 6, bool: 7, string: 8, array: 9, uint64: 10 } as const;
/** ggml's tensor type code for float32. */
const GGML_TYPE_F32 = 0;
const MAGIC = 0x46554747; // "GGUF", little-endian
const VERSION = 3;
export const GGUF_DEFAULT_ALIGNMENT = 32;

/** Grows a little-endian byte buffer. */
class ByteSink {
  private bytes = new Uint8Array(1 << 16);
  private view = new DataView(this.bytes.buffer);
  length = 0;

  private reserve(extra: number): void {
    if (this.length + extra <= this.bytes.length) return;
    let size = this.bytes.length * 2;
    while (size < this.length + extra) size *= 2;
    const next = new Uint8Array(size);
    next.set(this.bytes.subarray(0, this.length));
    this.bytes = next;
    this.view = new DataView(next.buffer);
  }

  /** Appends a fixed-size little-endian number. */
  #fixed(size: number, set: (view: DataView, at: number) => void): void {
    this.reserve(size);
    set(this.view, this.length);
    this.length += size;
  }

  u8(value: number): void {
    this.#fixed(1, (view, at) => view.setUint8(at, value));
  }

  u32(value: number): void {
    this.#fixed(4, (view, at) => view.setUint32(at, value, true));
  }

  i32(value: number): void {
    this.#fixed(4, (view, at) => view.setInt32(at, value, true));
  }

  u64(value: number): void {
    this.#fixed(8, (view, at) => view.setBigUint64(at, BigInt(value), true));
  }

  f32(value: number): void {
    this.#fixed(4, (view, at) => view.setFloat32(at, value, true));
  }

  /** A GGUF string: u64 byte length, then UTF-8 bytes (no terminator). */
  string(value: string): void {
    const encoded = new TextEncoder().encode(value);
    this.u64(encoded.length);
    this.reserve(encoded.length);
    this.bytes.set(encoded, this.length);
    this.length += encoded.length;
  }

  padTo(alignment: number): void {
    while (this.length % alignment !== 0) this.u8(0);
  }

  result(): Uint8Array {
    return this.bytes.slice(0, this.length);
  }
}

function writeValue(sink: ByteSink, entry: GgufValue): void {
  switch (entry.type) {
    case 'uint32':
      sink.u32(TYPE.uint32);
      sink.u32(entry.value);
      return;
    case 'int32':
      sink.u32(TYPE.int32);
      sink.i32(entry.value);
      return;
    case 'float32':
      sink.u32(TYPE.float32);
      sink.f32(entry.value);
      return;
    case 'bool':
      sink.u32(TYPE.bool);
      sink.u8(entry.value ? 1 : 0);
      return;
    case 'string':
      sink.u32(TYPE.string);
      sink.string(entry.value);
      return;
    case 'string[]':
      sink.u32(TYPE.array);
      sink.u32(TYPE.string);
      sink.u64(entry.value.length);
      for (const item of entry.value) sink.string(item);
      return;
    case 'int32[]':
      sink.u32(TYPE.array);
      sink.u32(TYPE.int32);
      sink.u64(entry.value.length);
      for (const item of entry.value) sink.i32(item);
      return;
  }
}

const alignUp = (value: number, alignment: number): number => Math.ceil(value / alignment) * alignment;

/**
 * Encodes a GGUF file as a list of chunks (the header, then each tensor's bytes and padding), so a
 * model of hundreds of MB is written without being copied into one buffer. Write them in order.
 */
export function encodeGguf(metadata: ReadonlyMap<string, GgufValue>, tensors: readonly GgufTensor[]): Uint8Array[] {
  const alignmentEntry = metadata.get('general.alignment');
  const alignment = alignmentEntry?.type === 'uint32' ? alignmentEntry.value : GGUF_DEFAULT_ALIGNMENT;
  const names = new Set<string>();
  const header = new ByteSink();
  header.u32(MAGIC);
  header.u32(VERSION);
  header.u64(tensors.length);
  header.u64(metadata.size);
  for (const [key, value] of metadata) {
    header.string(key);
    writeValue(header, value);
  }
  let offset = 0;
  for (const tensor of tensors) {
    if (names.has(tensor.name)) throw new Error(`duplicate tensor ${tensor.name}`);
    names.add(tensor.name);
    const elements = tensor.shape.reduce((a, b) => a * b, 1);
    if (elements !== tensor.data.length) {
      throw new Error(`tensor ${tensor.name}: shape [${tensor.shape.join(', ')}] holds ${elements} values, data has ${tensor.data.length}`);
    }
    header.string(tensor.name);
    header.u32(tensor.shape.length);
    // ggml lists dimensions innermost first.
    for (const dim of [...tensor.shape].reverse()) header.u64(dim);
    header.u32(GGML_TYPE_F32);
    header.u64(offset);
    offset = alignUp(offset + tensor.data.byteLength, alignment);
  }
  header.padTo(alignment);

  const chunks: Uint8Array[] = [header.result()];
  for (const tensor of tensors) {
    // GGUF is little-endian, as are the machines this runs on (x86-64, arm64).
    chunks.push(new Uint8Array(tensor.data.buffer, tensor.data.byteOffset, tensor.data.byteLength));
    const padding = alignUp(tensor.data.byteLength, alignment) - tensor.data.byteLength;
    if (padding > 0) chunks.push(new Uint8Array(padding));
  }
  return chunks;
}
