/** KV elements: float32, or float16 kept as raw bits (the engine copies them, never reads them). */
export type KvData = Float32Array | Uint16Array;

/** The dimensions of one model's KV cache (read from the ONNX graph). */
export interface KvShape {
  numLayers: number;
  numKvHeads: number;
  headDim: number;
  dtype: 'float32' | 'float16';
}

/** One row's real slots in a raw KV tensor set, as [start, length] runs along the slot axis. */
export interface KvRowSource {
  /** 2 × numLayers arrays laid out [rows, numKvHeads, slots, headDim]: layer i key at 2i, value at 2i + 1. */
  data: readonly KvData[];
  slots: number;
  row: number;
  segments: ReadonlyArray<readonly [start: number, length: number]>;
}

/**
 * Rows of KV cache packed the way the model takes `past_key_values`: per layer one tensor
 * [rows, numKvHeads, pastLength, headDim], each row left-padded, its real slots the last
 * `lengths[row]` of `pastLength`, padded slots zero.
 *
 * A batch is immutable. A decode step's `present.*` outputs are already the next step's batch
 * (`appended`, no copy); only a change of rows (join, leave) or a ragged call's gaps need `gather`,
 * which copies each kept row once.
 */
export class KvBatch {
  readonly shape: KvShape;
  readonly data: readonly KvData[];
  readonly lengths: readonly number[];
  readonly pastLength: number;

  constructor(shape: KvShape, data: readonly KvData[], lengths: readonly number[], pastLength: number) {
    this.shape = shape;
    this.data = data;
    this.lengths = lengths;
    this.pastLength = pastLength;
  }

  get rows(): number {
    return this.lengths.length;
  }

  /** Slots held, padding included (what the memory cap counts). */
  get slotCount(): number {
    return this.rows * this.pastLength;
  }

  /** A batch of rows with nothing cached yet. */
  static empty(shape: KvShape, rows: number): KvBatch {
    const data = Array.from({ length: shape.numLayers * 2 }, () => allocate(shape, 0));
    return new KvBatch(shape, data, new Array<number>(rows).fill(0), 0);
  }

  /** The compact source of one of this batch's rows. */
  rowSource(row: number): KvRowSource {
    const length = this.lengths[row] ?? 0;
    return { data: this.data, slots: this.pastLength, row, segments: [[this.pastLength - length, length]] };
  }

  /**
   * Copies rows (from any batches or raw outputs, a source may repeat: n siblings sharing one
   * prefilled prompt) into a new left-padded batch as long as its longest row.
   */
  static gather(shape: KvShape, sources: readonly KvRowSource[]): KvBatch {
    const lengths = sources.map((source) => source.segments.reduce((sum, [, length]) => sum + length, 0));
    const pastLength = Math.max(0, ...lengths);
    const { numKvHeads: heads, headDim } = shape;
    const data: KvData[] = [];
    for (let k = 0; k < shape.numLayers * 2; k++) {
      const out = allocate(shape, sources.length * heads * pastLength * headDim);
      sources.forEach((source, row) => {
        const input = source.data[k]!;
        for (let h = 0; h < heads; h++) {
          let at = ((row * heads + h) * pastLength + pastLength - lengths[row]!) * headDim;
          for (const [start, length] of source.segments) {
            const from = ((source.row * heads + h) * source.slots + start) * headDim;
            out.set(input.subarray(from, from + length * headDim), at);
            at += length * headDim;
          }
        }
      });
      data.push(out);
    }
    return new KvBatch(shape, data, lengths, pastLength);
  }

  /**
   * The cache after a model call on this batch that fed `newTokens` real tokens on every row and
   * returned only their key/value slices ([rows, heads, newTokens, headDim] per layer): each row's
   * cache followed by its new slots, copied once into a new batch.
   */
  appendedNew(newKv: readonly KvData[], newTokens: number): KvBatch {
    const { numKvHeads: heads, headDim } = this.shape;
    const past = this.pastLength * headDim;
    const fresh = newTokens * headDim;
    const slots = this.pastLength + newTokens;
    const data = this.data.map((input, k) => {
      const added = newKv[k]!;
      const out = allocate(this.shape, this.rows * heads * slots * headDim);
      for (let block = 0; block < this.rows * heads; block++) {
        const to = block * slots * headDim;
        out.set(input.subarray(block * past, (block + 1) * past), to);
        out.set(added.subarray(block * fresh, (block + 1) * fresh), to + past);
      }
      return out;
    });
    return new KvBatch(
      this.shape,
      data,
      this.lengths.map((length) => length + newTokens),
      slots,
    );
  }

  /**
   * The cache after a model call on this batch that fed `newTokens` slots per row, right-aligned
   * with `added[row]` real tokens each (`present.*` is [rows, heads, pastLength + newTokens, headDim]).
   * When every row filled all new slots the outputs are used as they are; otherwise the gaps are
   * squeezed out by a copy.
   */
  appended(present: readonly KvData[], newTokens: number, added: readonly number[]): KvBatch {
    const slots = this.pastLength + newTokens;
    const lengths = this.lengths.map((length, row) => length + added[row]!);
    if (added.every((count) => count === newTokens)) return new KvBatch(this.shape, present, lengths, slots);
    return KvBatch.gather(
      this.shape,
      this.lengths.map((length, row) => ({
        data: present,
        slots,
        row,
        segments: [
          [this.pastLength - length, length],
          [slots - added[row]!, added[row]!],
        ],
      })),
    );
  }
}

function allocate(shape: KvShape, size: number): KvData {
  return shape.dtype === 'float16' ? new Uint16Array(size) : new Float32Array(size);
}
