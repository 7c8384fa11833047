/** Names of a decoder's KV cache inputs and outputs (Optimum's, which every supported export uses). */
export const PAST_INPUT = /^past_key_values\.(\d+)\.(key|value)$/;
export const PRESENT_OUTPUT = /^present\.(\d+)\.(key|value)$/;

/** Names matching `pattern` (layer, key|value) ordered layer 0 key, layer 0 value, layer 1 key, ... */
export function orderedKvNames(names: readonly string[], pattern: RegExp): string[] {
  return names
    .map((name) => ({ name, match: pattern.exec(name) }))
    .filter((entry): entry is { name: string; match: RegExpExecArray } => entry.match !== null)
    .sort((a, b) => Number(a.match[1]) * 2 + (a.match[2] === 'key' ? 0 : 1) - (Number(b.match[1]) * 2 + (b.match[2] === 'key' ? 0 : 1)))
    .map((entry) => entry.name);
}
