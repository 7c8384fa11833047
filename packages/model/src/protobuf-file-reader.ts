import { readSync } from 'node:fs';
import { ModelDirError } from './model-dir-error.js';

/** Protobuf wire types. */
export const WIRE = { varint: 0, fixed64: 1, bytes: 2, fixed32: 5 } as const;

/** One field of a protobuf message, as it lies in the file. */
export interface Field {
  number: number;
  wireType: number;
  /** Where the field's key starts: `at` to `end` is the whole field, as encoded. */
  at: number;
  /** Payload span: for length-delimited fields the bytes, otherwise the encoded value. */
  start: number;
  end: number;
}

const CHUNK_BYTES = 1 << 16;
const textDecoder = new TextDecoder();

/** Random access to a protobuf file through a small read buffer. */
export class FileReader {
  /** What one read fills at least: longer spans {@link bytes} reads whole. */
  readonly chunkBytes = CHUNK_BYTES;
  #chunk = Buffer.alloc(0);
  #chunkStart = 0;

  constructor(
    readonly fd: number,
    readonly size: number,
    readonly file: string,
  ) {}

  malformed(problem: string): never {
    throw new ModelDirError(this.file, `not a valid ONNX model: ${problem}`);
  }

  bytes(position: number, length: number): Uint8Array {
    if (position < 0 || position + length > this.size) this.malformed('truncated');
    const offset = position - this.#chunkStart;
    if (offset < 0 || offset + length > this.#chunk.length) {
      this.#chunk = Buffer.allocUnsafe(Math.min(Math.max(length, CHUNK_BYTES), this.size - position));
      this.#chunkStart = position;
      this.readInto(this.#chunk, position);
      return this.#chunk.subarray(0, length);
    }
    return this.#chunk.subarray(offset, offset + length);
  }

  /** Fills `into` with the file's bytes from `position` on (past the reader's buffer). */
  readInto(into: Uint8Array, position: number): void {
    if (position < 0 || position + into.length > this.size) this.malformed('truncated');
    let filled = 0;
    while (filled < into.length) {
      const read = readSync(this.fd, into, filled, into.length - filled, position + filled);
      if (read === 0) this.malformed('truncated');
      filled += read;
    }
  }

  string(field: Field): string {
    return textDecoder.decode(this.bytes(field.start, field.end - field.start));
  }

  /** Reads a base-128 varint; numbers stay exact up to 2^53. */
  varint(position: number): [value: number, next: number] {
    const bytes = this.bytes(position, Math.min(10, this.size - position));
    let value = 0;
    let scale = 1;
    for (let i = 0; i < bytes.length; i++) {
      const byte = bytes[i]!;
      value += (byte & 0x7f) * scale;
      if (byte < 0x80) return [value, position + i + 1];
      scale *= 128;
    }
    return this.malformed('bad varint');
  }

  *fields(start: number, end: number): Generator<Field> {
    let position = start;
    while (position < end) {
      const [key, afterKey] = this.varint(position);
      const number = Math.floor(key / 8);
      const wireType = key % 8;
      let field: Field;
      if (wireType === WIRE.varint) {
        field = { number, wireType, at: position, start: afterKey, end: this.varint(afterKey)[1] };
      } else if (wireType === WIRE.fixed64) {
        field = { number, wireType, at: position, start: afterKey, end: afterKey + 8 };
      } else if (wireType === WIRE.fixed32) {
        field = { number, wireType, at: position, start: afterKey, end: afterKey + 4 };
      } else if (wireType === WIRE.bytes) {
        const [length, afterLength] = this.varint(afterKey);
        field = { number, wireType, at: position, start: afterLength, end: afterLength + length };
      } else {
        return this.malformed(`unsupported wire type ${wireType}`);
      }
      if (number === 0 || field.end > end) this.malformed('truncated or corrupt message');
      yield field;
      position = field.end;
    }
  }
}
