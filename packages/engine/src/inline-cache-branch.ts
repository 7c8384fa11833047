/**
 * Merged decoders (Optimum's `decoder_model_merged.onnx`): the whole decoder sits in the two branches
 * of one `If` on a `use_cache_branch` input, `then_branch` the decoder with past, `else_branch` one
 * without. The engine always has a past (empty for a row's first call, which the with-past decoder
 * takes: Optimum's own single-file exports are that decoder alone), so the load-time rewrite replaces
 * the `If` by its with-past branch; the rest of the rewrite then sees the decoder as a plain export.
 */
import onnxProto from 'onnx-proto';
import { USE_CACHE_BRANCH } from '@sluice/model';

const { onnx } = onnxProto;

type Graph = onnxProto.onnx.IGraphProto;
type Node = onnxProto.onnx.INodeProto;

/** What {@link inlineCacheBranch} did. */
export type CacheBranchInlining =
  /** The graph has no `If` on `use_cache_branch`: nothing to do. */
  | 'none'
  /** The `If` was replaced by its with-past branch; `use_cache_branch` is no longer an input. */
  | 'inlined'
  /** There is such an `If` but not in a form taken here (the graph is left as it was found). */
  | 'refused';

/** Every name a node reads, its subgraphs' reads included. */
function namesRead(nodes: readonly Node[]): Set<string> {
  const read = new Set<string>();
  const visit = (list: readonly Node[]): void => {
    for (const node of list) {
      for (const input of node.input ?? []) read.add(input);
      for (const attribute of node.attribute ?? []) for (const sub of [attribute.g, ...(attribute.graphs ?? [])]) visit(sub?.node ?? []);
    }
  };
  visit(nodes);
  return read;
}

/** Renames what nodes read and write, subgraphs included (names a subgraph reads from outside it). */
function rename(nodes: readonly Node[], names: ReadonlyMap<string, string>): void {
  for (const node of nodes) {
    node.input = (node.input ?? []).map((name) => names.get(name) ?? name);
    node.output = (node.output ?? []).map((name) => names.get(name) ?? name);
    for (const attribute of node.attribute ?? [])
      for (const sub of [attribute.g, ...(attribute.graphs ?? [])]) rename(sub?.node ?? [], names);
  }
}

/**
 * Replaces, in place, the `If` on `use_cache_branch` by its `then_branch` (the decoder with past):
 * the branch's nodes take the `If`'s place, its outputs its output names, its initializers join the
 * graph's, and the `use_cache_branch` input goes. Refused (graph untouched) when there is more than
 * one such `If`, when the branch reads none of `pastNames` (not a with-past decoder), when its names
 * would clash with the graph's, when its outputs do not match the `If`'s, or when anything else
 * reads `use_cache_branch`.
 */
export function inlineCacheBranch(graph: Graph, pastNames: readonly string[]): CacheBranchInlining {
  const nodes = graph.node ?? [];
  const ifs = nodes.filter((node) => node.opType === 'If' && (node.domain ?? '') === '' && node.input?.[0] === USE_CACHE_BRANCH);
  if (ifs.length === 0) return 'none';
  const [node] = ifs;
  if (ifs.length > 1 || node === undefined) return 'refused';
  const branch = (node.attribute ?? []).find((attribute) => attribute.name === 'then_branch')?.g;
  if (branch == null) return 'refused';
  const branchNodes = branch.node ?? [];
  const outputs = node.output ?? [];
  const branchOutputs = (branch.output ?? []).map((output) => output.name ?? '');
  if (branchOutputs.length !== outputs.length || (branch.sparseInitializer ?? []).length > 0) return 'refused';
  const read = namesRead(branchNodes);
  if (!pastNames.some((name) => read.has(name))) return 'refused';
  const others = nodes.filter((other) => other !== node);
  if (read.has(USE_CACHE_BRANCH) || namesRead(others).has(USE_CACHE_BRANCH)) return 'refused';

  // Names the branch defines must not clash with the graph's own (other than the If's outputs, which it takes over).
  const taken = new Set([
    ...(graph.input ?? []).map((input) => input.name ?? ''),
    ...(graph.initializer ?? []).map((tensor) => tensor.name ?? ''),
    ...others.flatMap((other) => other.output ?? []),
  ]);
  const defined = [...(branch.initializer ?? []).map((tensor) => tensor.name ?? ''), ...branchNodes.flatMap((inner) => inner.output ?? [])];
  if (defined.some((name) => name !== '' && taken.has(name))) return 'refused';
  const producedInBranch = new Set(branchNodes.flatMap((inner) => inner.output ?? []));
  // A branch output the branch computes is renamed to the If's output; one it passes through
  // (a graph input or initializer) gets an Identity.
  const renames = new Map<string, string>();
  const passed: Array<[from: string, output: string]> = [];
  for (const [i, output] of outputs.entries()) {
    const from = branchOutputs[i]!;
    if (from === output) continue;
    if (producedInBranch.has(from) && !renames.has(from) && !defined.includes(output)) renames.set(from, output);
    else passed.push([from, output]);
  }
  rename(branchNodes, renames);
  // (A name the branch outputs twice was renamed for the first: the Identity reads it under that name.)
  const identities = passed.map(([from, output]) =>
    onnx.NodeProto.create({ name: `sluice_if_output/${output}`, opType: 'Identity', input: [renames.get(from) ?? from], output: [output] }),
  );

  graph.node = nodes.flatMap((other) => (other === node ? [...branchNodes, ...identities] : [other]));
  graph.initializer = [...(graph.initializer ?? []), ...(branch.initializer ?? [])];
  const described = new Set((graph.valueInfo ?? []).map((entry) => entry.name ?? ''));
  graph.valueInfo = [...(graph.valueInfo ?? []), ...(branch.valueInfo ?? []).filter((entry) => !described.has(entry.name ?? ''))];
  graph.input = (graph.input ?? []).filter((input) => input.name !== USE_CACHE_BRANCH);
  return 'inlined';
}
