import onnxProto from 'onnx-proto';
import { describe, expect, it } from 'vitest';
import { inlineCacheBranch } from '../src/inline-cache-branch.js';

const { onnx } = onnxProto;

const PAST = ['past_key_values.0.key', 'past_key_values.0.value'];

const info = (name: string): onnxProto.onnx.IValueInfoProto => ({ name, type: { tensorType: { elemType: 1 } } });
const node = (opType: string, input: string[], output: string[]): onnxProto.onnx.INodeProto => ({
  name: output[0] ?? opType,
  opType,
  input,
  output,
});

/**
 * A merged decoder's outline: an If on `use_cache_branch` whose with-past branch concatenates the
 * past with a new slice (its outputs named `branchOutputs`), and whose no-past branch does not read it.
 */
function merged(
  options: { branchOutputs?: string[]; withPastReads?: string; branchInitializer?: string; extraNodes?: onnxProto.onnx.INodeProto[] } = {},
): onnxProto.onnx.IGraphProto {
  const [logits = 'logits', key = 'present.0.key', value = 'present.0.value'] = options.branchOutputs ?? [];
  const past = options.withPastReads ?? 'past_key_values.0.key';
  const withPast: onnxProto.onnx.IGraphProto = {
    name: 'with_past',
    node: [
      node('MatMul', ['input_ids', 'weight'], ['new']),
      node('Concat', [past, 'new'], [key]),
      node('Concat', ['past_key_values.0.value', 'new'], [value]),
      node('Add', ['new', 'bias'], [logits]),
    ],
    initializer: [{ name: options.branchInitializer ?? 'bias', dims: [], dataType: 1, floatData: [1] }],
    output: [info(logits), info(key), info(value)],
  };
  const noPast: onnxProto.onnx.IGraphProto = {
    name: 'no_past',
    node: [node('MatMul', ['input_ids', 'weight'], ['present.0.key']), node('Identity', ['present.0.key'], ['present.0.value'])],
    output: [info('logits'), info('present.0.key'), info('present.0.value')],
  };
  return {
    name: 'merged',
    input: [...['input_ids', ...PAST].map(info), info('use_cache_branch')],
    initializer: [{ name: 'weight', dims: [2, 2], dataType: 1, floatData: [1, 2, 3, 4] }],
    node: [
      ...(options.extraNodes ?? []),
      {
        name: 'optimum::if',
        opType: 'If',
        input: ['use_cache_branch'],
        output: ['logits', 'present.0.key', 'present.0.value'],
        attribute: [
          { name: 'then_branch', type: onnx.AttributeProto.AttributeType.GRAPH, g: withPast },
          { name: 'else_branch', type: onnx.AttributeProto.AttributeType.GRAPH, g: noPast },
        ],
      },
    ],
    output: [info('logits'), info('present.0.key'), info('present.0.value')],
  };
}

const snapshot = (graph: onnxProto.onnx.IGraphProto) => onnx.GraphProto.toObject(onnx.GraphProto.create(graph));

describe('inlineCacheBranch (a merged decoder’s If replaced by its with-past branch)', () => {
  it('puts the branch’s nodes and initializers in the graph and drops use_cache_branch', () => {
    const graph = merged();
    expect(inlineCacheBranch(graph, PAST)).toBe('inlined');
    expect(graph.node?.map((entry) => entry.opType)).toEqual(['MatMul', 'Concat', 'Concat', 'Add']);
    expect(graph.initializer?.map((tensor) => tensor.name)).toEqual(['weight', 'bias']);
    expect(graph.input?.map((input) => input.name)).toEqual(['input_ids', ...PAST]);
    expect(graph.node?.find((entry) => entry.output?.[0] === 'present.0.key')?.input).toEqual(['past_key_values.0.key', 'new']);
  });

  it('renames branch outputs named otherwise to the If’s outputs, where the branch computes them', () => {
    const graph = merged({ branchOutputs: ['branch/logits', 'branch/key', 'branch/value'] });
    expect(inlineCacheBranch(graph, PAST)).toBe('inlined');
    const producers = new Map(graph.node!.flatMap((entry) => entry.output!.map((output) => [output, entry.opType])));
    expect(producers.get('logits')).toBe('Add');
    expect(producers.get('present.0.key')).toBe('Concat');
    expect([...producers.keys()].some((name) => name.startsWith('branch/'))).toBe(false);
  });

  it('gives a branch output that passes a graph input through an Identity', () => {
    const graph = merged({ branchOutputs: ['logits', 'present.0.key', 'input_ids'] });
    // The branch's third output is now the graph input itself; the Concat that wrote it writes 'input_ids' no more.
    graph.node![0]!.attribute![0]!.g!.node![2]!.output = ['unused'];
    expect(inlineCacheBranch(graph, PAST)).toBe('inlined');
    expect(graph.node?.at(-1)).toMatchObject({ opType: 'Identity', input: ['input_ids'], output: ['present.0.value'] });
  });

  it('gives a tensor the branch outputs twice to both of the If’s outputs', () => {
    const graph = merged({ branchOutputs: ['branch/logits', 'branch/key', 'branch/key'] });
    graph.node![0]!.attribute![0]!.g!.node![2]!.output = ['unused'];
    expect(inlineCacheBranch(graph, PAST)).toBe('inlined');
    expect(graph.node?.filter((entry) => entry.opType === 'Concat').map((entry) => entry.output)).toEqual([['present.0.key'], ['unused']]);
    expect(graph.node?.at(-1)).toMatchObject({ opType: 'Identity', input: ['present.0.key'], output: ['present.0.value'] });
  });

  it('does nothing to a graph without the If', () => {
    const graph: onnxProto.onnx.IGraphProto = { input: [info('input_ids')], node: [node('Identity', ['input_ids'], ['logits'])] };
    const before = snapshot(graph);
    expect(inlineCacheBranch(graph, PAST)).toBe('none');
    expect(snapshot(graph)).toEqual(before);
  });

  it.each([
    ['its with-past branch reads no past', merged({ withPastReads: 'input_ids' }), ['past_key_values.9.key']],
    ['a branch initializer has the name of one of the graph’s', merged({ branchInitializer: 'weight' }), PAST],
    ['another node reads use_cache_branch', merged({ extraNodes: [node('Not', ['use_cache_branch'], ['flag'])] }), PAST],
  ] as const)('refuses, leaving the graph as it was, when %s', (_, graph, pastNames) => {
    const before = snapshot(graph);
    expect(inlineCacheBranch(graph, pastNames)).toBe('refused');
    expect(snapshot(graph)).toEqual(before);
  });

  it('refuses two Ifs on use_cache_branch', () => {
    const graph = merged();
    graph.node = [...graph.node!, { ...graph.node![0]!, name: 'second', output: ['a', 'b', 'c'] }];
    expect(inlineCacheBranch(graph, PAST)).toBe('refused');
  });
});
