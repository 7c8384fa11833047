/** One row of a model call: what it has cached and the new tokens it feeds. */
export interface RowInput {
  cachedLength: number;
  tokens: readonly number[];
}

/** int64 inputs of one model call over a left-padded batch. */
export interface PackedInputs {
  rows: number;
  /** Slot-axis length of `past_key_values` (the batch's longest cached row). */
  pastLength: number;
  /** New slots per row: the longest row's token count; shorter rows are left-padded. */
  newTokens: number;
  /** [rows, newTokens] */
  inputIds: BigInt64Array;
  /** [rows, pastLength + newTokens]: 1 on real slots (cached and new), 0 on padding. */
  attentionMask: BigInt64Array;
  /** [rows, newTokens]: each row's true positions, counted from its own first token. */
  positionIds: BigInt64Array;
}

/**
 * Builds input_ids, attention_mask and position_ids for rows whose cache is right-aligned in
 * `pastLength` slots and whose new tokens are right-aligned in the new slots, so every row's last
 * token sits in the last column. Padded slots are masked. The engine feeds it one prompt chunk, or
 * one token a row (the `present.*` fallback), so no row's new tokens are padded: a rewritten graph
 * reads each row's logits at the count of its real new tokens minus one
 * (`RewrittenGraph.lastRealTokenLogits`), which is the last column only then; prompts that share a
 * call go through {@link packPrompts}.
 */
export function packInputs(pastLength: number, rows: readonly RowInput[], padTokenId: number): PackedInputs {
  const newTokens = Math.max(0, ...rows.map((row) => row.tokens.length));
  const total = pastLength + newTokens;
  const { inputIds, attentionMask, positionIds, ids32, mask32, positions32 } = int64Inputs(rows.length, newTokens, total);
  rows.forEach((row, r) => {
    const count = row.tokens.length;
    const pad = newTokens - count;
    for (let j = 0; j < newTokens; j++) {
      const at = (r * newTokens + j) * 2;
      if (j < pad) {
        ids32[at] = padTokenId;
      } else {
        ids32[at] = row.tokens[j - pad]!;
        positions32[at] = row.cachedLength + j - pad;
      }
    }
    for (let s = pastLength - row.cachedLength; s < pastLength; s++) mask32[(r * total + s) * 2] = 1;
    for (let s = pastLength + pad; s < total; s++) mask32[(r * total + s) * 2] = 1;
  });
  return { rows: rows.length, pastLength, newTokens, inputIds, attentionMask, positionIds };
}

/**
 * Builds the inputs of one call over whole prompts with nothing cached, right-padded: each row's
 * tokens first in the new slots, then padding (masked, at the positions after the prompt). Each row's
 * tokens and keys then sit at the indices they have in a call of their own, which a graph whose
 * logits are read at each row's last real token ({@link OnnxSession.lastRealTokenLogits}) needs for a
 * row's numbers not to depend on the others: onnxruntime's softmax sums a row's scores in vector
 * lanes by index (docs/engine.md, "Batch invariance"). A row's real tokens are its first
 * `tokens.length` slots.
 */
export function packPrompts(rows: ReadonlyArray<readonly number[]>, padTokenId: number): PackedInputs {
  const newTokens = Math.max(0, ...rows.map((tokens) => tokens.length));
  const { inputIds, attentionMask, positionIds, ids32, mask32, positions32 } = int64Inputs(rows.length, newTokens, newTokens);
  rows.forEach((tokens, r) => {
    for (let j = 0; j < newTokens; j++) {
      const at = (r * newTokens + j) * 2;
      ids32[at] = j < tokens.length ? tokens[j]! : padTokenId;
      mask32[at] = j < tokens.length ? 1 : 0;
      positions32[at] = j;
    }
  });
  return { rows: rows.length, pastLength: 0, newTokens, inputIds, attentionMask, positionIds };
}

/**
 * Inputs of one decode call over a {@link LaneKv}-style cache: `capacity` past slots per row with
 * the row's real slots left-aligned in [0, cachedLength) (the rest masked) and one new token in
 * slot `capacity`, at the row's true position `cachedLength`.
 */
export function packLaneInputs(capacity: number, rows: ReadonlyArray<{ cachedLength: number; token: number }>): PackedInputs {
  const total = capacity + 1;
  const { inputIds, attentionMask, positionIds, ids32, mask32, positions32 } = int64Inputs(rows.length, 1, total);
  rows.forEach((row, r) => {
    ids32[r * 2] = row.token;
    positions32[r * 2] = row.cachedLength;
    for (let s = 0; s < row.cachedLength; s++) mask32[(r * total + s) * 2] = 1;
    mask32[(r * total + capacity) * 2] = 1;
  });
  return { rows: rows.length, pastLength: capacity, newTokens: 1, inputIds, attentionMask, positionIds };
}

/**
 * The three int64 inputs of a call of `rows` rows, `newTokens` new slots and `total` slots, zeroed,
 * each with an int32 view: writing an int64 through it (low word, sign word) avoids a BigInt per
 * element.
 */
function int64Inputs(rows: number, newTokens: number, total: number) {
  const inputIds = new BigInt64Array(rows * newTokens);
  const attentionMask = new BigInt64Array(rows * total);
  const positionIds = new BigInt64Array(rows * newTokens);
  return {
    inputIds,
    attentionMask,
    positionIds,
    ids32: new Int32Array(inputIds.buffer),
    mask32: new Int32Array(attentionMask.buffer),
    positions32: new Int32Array(positionIds.buffer),
  };
}
