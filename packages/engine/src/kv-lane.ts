import type { KvData, KvRowSource, KvShape } from './kv-batch.js';
import type { KvGrowth } from './types.js';

/** Capacity grows (and shrinks) in blocks of this many slots. */
export const KV_BLOCK = 64;

/**
 * The capacity is always a multiple of this many slots: onnxruntime's softmax sums a row's scores
 * in vector lanes by index, one accumulator (MLAS: 16 lanes with AVX-512, 8 with AVX2), and a decode
 * step's new slot sits at index `capacity`, so only then does it land in the same lane whatever the
 * capacity, and a row's scores are summed in the same order in any lane it shares (docs/engine.md,
 * "Batch invariance"). Growth targets are whole {@link KV_BLOCK}s; a reservation between them is
 * rounded up to this.
 */
export const KV_ALIGN = 16;

/** `slots` rounded up to a multiple of `unit` (Infinity stays). */
function roundUp(slots: number, unit: number): number {
  return Math.ceil(slots / unit) * unit;
}

/** The least a growing capacity is multiplied by (then rounded up to a block). */
const GROWTH = 1.25;

/**
 * The decode rows' KV cache in engine-owned buffers, used when the session outputs each layer's
 * new key/value slice (`OnnxSession.outputsNewKv`). Per layer, key and value are fed as one tensor
 * [rows, numKvHeads, capacity, headDim] (a prefix view of a larger reusable buffer), each row's
 * real slots LEFT-aligned in [0, length), the slots after it zero and masked. The step's new token
 * sits in the graph's slot `capacity`; its key/value slice is written into the row's slot `length`
 * in place ({@link append}). A step copies O(rows) slots out of onnxruntime, not the whole cache.
 * The capacity is always a multiple of {@link KV_ALIGN}, so a row's logits do not depend on it to the bit.
 *
 * Rows change in place: a leaving row is replaced by the last row (one row copied), a joining row
 * is copied into the next free row. The capacity tracks the longest row, growing by at least a
 * quarter rounded up to {@link KV_BLOCK} (never past `limit`, the rows' longest reservation rounded
 * up to {@link KV_ALIGN}),
 * buffers are reallocated only when too small, then with room for `maxRows` rows of `limit` slots.
 *
 * Growing moves every row (each row's slots start at row × capacity): done in the one step that
 * needs it, that is a whole-cache copy holding up every row (30–80 ms at 32 rows × 576 slots of the
 * bench model, page faults included). With `growth: 'spread'` the next layout is built
 * in a second buffer set from the step after a growth on: each step copies an even share of what is
 * left (one layer's key or value of a row at a time) over the steps left before the next growth, rows
 * already copied also get each step's new slices there, and the two sets swap when the growth is due.
 * The price is the second set's memory (up to twice the lane's KV pages) and a second write of each
 * step's new slices.
 */
export class LaneKv {
  readonly shape: KvShape;
  /** Per layer key/value: the whole buffer (views of its prefix are fed). */
  #buffers: KvData[];
  readonly lengths: number[] = [];
  capacity = 0;

  /** The most rows the lane will hold (row headroom is never allocated past it). */
  readonly maxRows: number;
  readonly growth: KvGrowth;
  /** Whole-lane copies done within one step (a re-layout to grow without a prepared layout or to shrink, or a reallocation). */
  relayouts = 0;
  /** The second buffer set, where the next growth's layout is prepared (same length as the first). */
  #spare: KvData[] | undefined;
  /**
   * The growth being prepared in the spare set, laid out at `capacity`: `units` (row, tensor) pairs
   * copied, row-major (rows [0, units / tensors) whole, then the first units % tensors tensors of the next).
   */
  #next: { capacity: number; units: number } | undefined;

  constructor(shape: KvShape, maxRows = Infinity, growth: KvGrowth = 'in-place') {
    this.shape = shape;
    this.maxRows = maxRows;
    this.growth = growth;
    this.#buffers = Array.from({ length: shape.numLayers * 2 }, () => allocate(shape, 0));
  }

  get rows(): number {
    return this.lengths.length;
  }

  /**
   * Allocates the buffers for `maxRows` rows of up to `limit` slots (the longest reservation any
   * row can have) and writes zeros over the first `slots` slots of each, so those pages are faulted
   * in now rather than in the steps that first use them (~7 µs a page on this VM: ~180 ms for the
   * first 32 rows of the bench model, ~120 ms for their first growth). The lane's rows always lie in
   * its buffers' first rows × capacity slots, and capacity never passes the rows' longest
   * reservation rounded up to {@link KV_ALIGN}, so with `slots` at the engine's KV cap (plus that
   * rounding for each row) every page a step can touch is warm, and no later row reallocates. With
   * `spread` growth the second set is allocated and written too. Returns the bytes written.
   */
  preallocate(limit: number, slots: number): number {
    if (this.rows > 0 || !Number.isFinite(this.maxRows)) throw new Error('preallocate needs an empty lane with a row limit');
    const size = this.maxRows * this.#rowSize(this.#roomSlots(limit));
    const touched = Math.min(size, this.#rowSize(slots + this.maxRows * (KV_ALIGN - 1)));
    const warm = (): KvData[] => this.#buffers.map(() => allocate(this.shape, size).fill(0, 0, touched));
    this.#buffers = warm();
    this.#spare = this.growth === 'spread' ? warm() : undefined;
    this.#next = undefined;
    this.capacity = 0;
    const sets = this.#spare === undefined ? 1 : 2;
    return sets * this.#buffers.length * touched * this.#buffers[0]!.BYTES_PER_ELEMENT;
  }

  /** Slots per row a reallocation makes room for: `limit` rounded up by a growth step. */
  #roomSlots(limit: number): number {
    return roundUp(limit * GROWTH, KV_BLOCK);
  }

  /** Slots held in use, unused capacity of live rows included (what the memory cap counts). */
  get slotCount(): number {
    return this.rows * this.capacity;
  }

  /** The tensors fed as past: [rows, heads, capacity, headDim] views. */
  get data(): KvData[] {
    const size = this.rows * this.#rowSize(this.capacity);
    return this.#buffers.map((buffer) => buffer.subarray(0, size));
  }

  /** The compact source of one of this lane's rows (valid until the lane next changes). */
  rowSource(row: number): KvRowSource {
    return { data: this.#buffers, slots: this.capacity, row, segments: [[0, this.lengths[row] ?? 0]] };
  }

  /** Removes a row by moving the last row into its place (the caller mirrors that on its rows). */
  removeRow(row: number): void {
    const last = this.rows - 1;
    if (row !== last) {
      const size = this.#rowSize(this.capacity);
      for (const buffer of this.#buffers) buffer.copyWithin(row * size, last * size, (last + 1) * size);
      this.lengths[row] = this.lengths[last]!;
    }
    this.lengths.pop();
    const next = this.#next;
    if (next === undefined) return;
    // The moved row's copied tensors are stale in the spare: copy them again; the old last row's go.
    if (row !== last) {
      for (let k = 0; k < this.#buffers.length; k++) if (row < this.#rowsCopied(k)) this.#copyUnit(row, k, next.capacity);
    }
    next.units = Math.min(next.units, this.rows * this.#buffers.length);
  }

  /** Copies a row in as the last row; `limit` bounds the capacity (the rows' longest reservation, rounded up to {@link KV_ALIGN}). */
  addRow(source: KvRowSource, limit: number): void {
    const length = source.segments.reduce((sum, [, count]) => sum + count, 0);
    this.#ensure(Math.max(length, ...this.lengths) + 1, this.rows + 1, roundUp(limit, KV_ALIGN));
    const { numKvHeads: heads, headDim } = this.shape;
    const row = this.rows;
    const capacity = this.capacity;
    this.#buffers.forEach((out, k) => {
      const input = source.data[k]!;
      for (let h = 0; h < heads; h++) {
        const base = (row * heads + h) * capacity * headDim;
        let at = base;
        for (const [start, count] of source.segments) {
          const from = ((source.row * heads + h) * source.slots + start) * headDim;
          out.set(input.subarray(from, from + count * headDim), at);
          at += count * headDim;
        }
        out.fill(0, at, base + capacity * headDim);
      }
    });
    this.lengths.push(length);
  }

  /** Makes room for every row's next token (grows, or shrinks after long rows left), and prepares the next growth. */
  reserveNext(limit: number): void {
    const need = Math.max(0, ...this.lengths) + 1;
    const aligned = roundUp(limit, KV_ALIGN);
    this.#ensure(need, this.rows, aligned);
    if (this.growth === 'spread') this.#prepare(need, aligned);
  }

  /** Writes one step's new slices ([rows, heads, 1, headDim] per layer key/value) into each row's next slot. */
  append(newKv: readonly KvData[]): void {
    this.#buffers.forEach((out, k) => this.#writeSlices(out, this.capacity, newKv[k]!, this.rows));
    // Rows already copied into the next layout get their new slices there too.
    const next = this.#next;
    if (next !== undefined) this.#spare!.forEach((out, k) => this.#writeSlices(out, next.capacity, newKv[k]!, this.#rowsCopied(k)));
    for (let row = 0; row < this.rows; row++) this.lengths[row]! += 1;
  }

  /** One tensor's new slices of rows [0, rows) into slot `length` of a layout at `capacity`. */
  #writeSlices(out: KvData, capacity: number, input: KvData, rows: number): void {
    const { numKvHeads: heads, headDim } = this.shape;
    for (let row = 0; row < rows; row++) {
      const slot = this.lengths[row]!;
      for (let h = 0; h < heads; h++) {
        const from = (row * heads + h) * headDim;
        out.set(input.subarray(from, from + headDim), ((row * heads + h) * capacity + slot) * headDim);
      }
    }
  }

  #rowSize(capacity: number): number {
    return this.shape.numKvHeads * capacity * this.shape.headDim;
  }

  /** Like {@link #fit}, but a growth whose layout is prepared in the spare set swaps to it. */
  #ensure(need: number, rows: number, limit: number): void {
    const next = this.#next;
    if (
      next !== undefined &&
      need > this.capacity &&
      need <= next.capacity &&
      rows * this.#rowSize(next.capacity) <= this.#spare![0]!.length
    ) {
      for (const units = this.rows * this.#buffers.length; next.units < units; next.units++) this.#copyUnitAt(next.units, next.capacity);
      [this.#buffers, this.#spare] = [this.#spare!, this.#buffers];
      this.capacity = next.capacity;
      this.#next = undefined;
      return;
    }
    this.#fit(need, rows, limit);
  }

  /**
   * Copies into the next growth's layout an even share of what is left over the steps left before it
   * is due (the rows' length + 1 > capacity), at least one unit: however slowly the machine copies
   * (fresh pages fault in at ~7 µs each on this VM), no step carries much more than its share.
   */
  #prepare(need: number, limit: number): void {
    const target = this.#grown(this.capacity + 1, limit);
    if (this.rows === 0 || need > this.capacity || this.capacity >= limit || this.rows * this.#rowSize(target) > this.#buffers[0]!.length) {
      this.#next = undefined;
      return;
    }
    if (this.#next !== undefined && this.#next.capacity !== target) this.#next = undefined;
    const next = (this.#next ??= { capacity: target, units: 0 });
    if (this.#spare === undefined || this.#spare[0]!.length !== this.#buffers[0]!.length) {
      this.#spare = this.#buffers.map((buffer) => allocate(this.shape, buffer.length));
    }
    const tensors = this.#buffers.length;
    const units = this.rows * tensors;
    if (next.units >= units) return;
    let left = 0;
    for (let row = Math.floor(next.units / tensors); row < this.rows; row++) left += this.lengths[row]!;
    // This call and one per step until the growth: capacity - need + 1 chances. (Slots of all tensors.)
    const share = left / (this.capacity - need + 1);
    for (let slots = 0; next.units < units && slots < share; next.units++) {
      slots += this.lengths[Math.floor(next.units / tensors)]! / tensors;
      this.#copyUnitAt(next.units, next.capacity);
    }
  }

  /** Rows whose tensor `k` is already in the next layout. */
  #rowsCopied(k: number): number {
    const units = this.#next?.units ?? 0;
    const tensors = this.#buffers.length;
    return Math.floor(units / tensors) + (units % tensors > k ? 1 : 0);
  }

  #copyUnitAt(unit: number, toCapacity: number): void {
    this.#copyUnit(Math.floor(unit / this.#buffers.length), unit % this.#buffers.length, toCapacity);
  }

  /** One row's real slots of tensor `k` into the spare set's layout at `toCapacity`, the slots after them zeroed. */
  #copyUnit(row: number, k: number, toCapacity: number): void {
    const { numKvHeads: heads, headDim } = this.shape;
    const length = this.lengths[row]!;
    const input = this.#buffers[k]!;
    const out = this.#spare![k]!;
    for (let h = 0; h < heads; h++) {
      const at = (row * heads + h) * toCapacity * headDim;
      const start = (row * heads + h) * this.capacity * headDim;
      out.set(input.subarray(start, start + length * headDim), at);
      out.fill(0, at + length * headDim, at + toCapacity * headDim);
    }
  }

  /** The capacity a growth to `need` slots takes: at least a quarter more, rounded up to a block, within `limit`. */
  #grown(need: number, limit: number): number {
    // Growing moves every row, so it grows by at least a quarter: O(log length) re-layouts per lane
    // instead of one per block, for at most a quarter more padded slots attended over.
    const target = roundUp(Math.max(need, this.capacity * GROWTH), KV_BLOCK);
    // When the growth after this one could only reach the reservation, go there now: that last,
    // short growth would move the whole cache for a few slots (768 → 790 slots for rows reserving
    // 790). Still at most a quarter more padded slots.
    const reach = target * GROWTH >= limit ? limit : target;
    return roundUp(Math.max(need, Math.min(reach, limit)), KV_ALIGN);
  }

  /** Sets the capacity for `need` slots and room for `rows` rows, moving the current rows' slots. */
  #fit(need: number, rows: number, limit: number): void {
    const blocks = roundUp(need, KV_BLOCK);
    const rounded = need > this.capacity ? this.#grown(need, limit) : Math.max(need, Math.min(blocks, limit));
    // Keep the capacity while it fits and wastes less than the growth step plus two blocks.
    // (An empty lane, kept for reuse, takes the capacity its first row needs: nothing to move.)
    const keep =
      this.rows > 0 && need <= this.capacity && this.capacity < blocks * GROWTH + 2 * KV_BLOCK && this.capacity <= Math.max(need, limit);
    // Aligned even where a row needs more than its reservation (a defect elsewhere, not a reason to lose it).
    const capacity = keep ? this.capacity : roundUp(rounded, KV_ALIGN);
    if (capacity !== this.capacity) this.#next = undefined;
    const elements = rows * this.#rowSize(capacity);
    if (elements <= (this.#buffers[0]?.length ?? 0)) {
      if (capacity !== this.capacity) this.#relayout(capacity);
      return;
    }
    // Reallocate with headroom: room for every row the lane may hold and for every slot its rows
    // may need (`limit`, their longest reservation). A fresh allocation's pages are only faulted in
    // as rows are written, so unused room costs address space, not memory or time; growing into
    // a new buffer later would copy and fault the whole cache in one step.
    const roomRows = Number.isFinite(this.maxRows) ? Math.max(rows, this.maxRows) : Math.max(rows, 8, rows * 2);
    // Slots rounded up by a growth step: a row joining later with a slightly longer reservation then
    // still fits, instead of reallocating (copying the whole cache into fresh pages) when it grows.
    const roomSlots = Number.isFinite(limit) ? this.#roomSlots(Math.max(capacity, limit)) : capacity + KV_BLOCK;
    const size = roomRows * this.#rowSize(roomSlots);
    if (this.rows > 0) this.relayouts++;
    const { numKvHeads: heads, headDim } = this.shape;
    const old = this.capacity;
    this.#buffers = this.#buffers.map((input) => {
      const out = allocate(this.shape, size);
      for (let row = 0; row < this.rows; row++) {
        const length = this.lengths[row]!;
        for (let h = 0; h < heads; h++) {
          const from = (row * heads + h) * old * headDim;
          out.set(input.subarray(from, from + length * headDim), (row * heads + h) * capacity * headDim);
        }
      }
      return out;
    });
    this.#spare = undefined;
    this.#next = undefined;
    this.capacity = capacity;
  }

  /** Re-lays the rows out with another capacity inside the same buffers. */
  #relayout(capacity: number): void {
    if (this.rows > 0) this.relayouts++;
    const { numKvHeads: heads, headDim } = this.shape;
    const old = this.capacity;
    const blocks = this.rows * heads;
    for (const buffer of this.#buffers) {
      // Growing moves blocks to higher offsets: go from the last; shrinking: from the first.
      for (let i = 0; i < blocks; i++) {
        const block = capacity > old ? blocks - 1 - i : i;
        const length = this.lengths[Math.floor(block / heads)]!;
        const from = block * old * headDim;
        const to = block * capacity * headDim;
        if (from !== to) buffer.copyWithin(to, from, from + length * headDim);
        buffer.fill(0, to + length * headDim, to + capacity * headDim);
      }
    }
    this.capacity = capacity;
  }
}

function allocate(shape: KvShape, size: number): KvData {
  return shape.dtype === 'float16' ? new Uint16Array(size) : new Float32Array(size);
}
