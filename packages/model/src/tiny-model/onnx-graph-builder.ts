import onnxProto from 'onnx-proto';
import { exactOnnxInt64 } from '../onnx-proto.js';

const { onnx } = onnxProto;

/** Element types the generated graphs use. */
export type ElementType = 'float32' | 'int64' | 'bool';

/** A dimension of a graph input or output: a fixed size or a symbolic name such as `batch_size`. */
export type Dim = number | string;

/** A node attribute, tagged with its ONNX type (an integer 1 and a float 1.0 are different attributes). */
export type Attribute = { int: number } | { ints: readonly number[] } | { float: number } | { floats: readonly number[] };

/** Options of {@link OnnxGraphBuilder.node}. */
export interface NodeOptions {
  attributes?: Record<string, Attribute>;
  /** Number of outputs. @defaultValue 1 */
  outputs?: number;
  /** Node name; outputs are named after it. @defaultValue `<scope>/<OpType>_<n>` */
  name?: string;
  /** Names of the outputs (instead of names derived from the node name). */
  outputNames?: readonly string[];
  /** Operator domain, e.g. `com.microsoft` (imported at version 1). @defaultValue the default ONNX domain */
  domain?: string;
}

/** What {@link OnnxGraphBuilder.toBytes} writes into the model header. */
export interface ModelInfo {
  producerName: string;
  producerVersion: string;
  /** Key/value metadata stored in the model (`metadata_props`). */
  metadata?: Record<string, string>;
}

/** ONNX IR version and default-domain opset of every generated model (known good with ORT 1.30). */
export const IR_VERSION = 8;
export const OPSET_VERSION = 17;

const DATA_TYPE: Record<ElementType, number> = {
  float32: onnx.TensorProto.DataType.FLOAT,
  int64: onnx.TensorProto.DataType.INT64,
  bool: onnx.TensorProto.DataType.BOOL,
};

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** The bytes of a typed array in little-endian order, as ONNX `raw_data` requires. */
function littleEndianBytes(data: Float32Array | BigInt64Array): Uint8Array {
  if (LITTLE_ENDIAN) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength).slice();
  const out = new Uint8Array(data.byteLength);
  const view = new DataView(out.buffer);
  if (data instanceof Float32Array) data.forEach((v, i) => view.setFloat32(i * 4, v, true));
  else data.forEach((v, i) => view.setBigInt64(i * 8, v, true));
  return out;
}

function valueInfo(name: string, type: ElementType, dims: readonly Dim[]): onnxProto.onnx.IValueInfoProto {
  return {
    name,
    type: {
      tensorType: {
        elemType: DATA_TYPE[type],
        shape: { dim: dims.map((d) => (typeof d === 'number' ? { dimValue: d } : { dimParam: d })) },
      },
    },
  };
}

function attributeProto(name: string, value: Attribute): onnxProto.onnx.IAttributeProto {
  const Type = onnx.AttributeProto.AttributeType;
  if ('int' in value) return { name, type: Type.INT, i: value.int };
  if ('ints' in value) return { name, type: Type.INTS, ints: [...value.ints] };
  if ('float' in value) return { name, type: Type.FLOAT, f: value.float };
  return { name, type: Type.FLOATS, floats: [...value.floats] };
}

/**
 * Builds one ONNX graph node by node and serializes it as a model. Only the default domain unless
 * a node names another (the `gqa` attention form uses `com.microsoft` GroupQueryAttention, which
 * only onnxruntime runs).
 */
export class OnnxGraphBuilder {
  private readonly nodes: onnxProto.onnx.INodeProto[] = [];
  private readonly initializers: onnxProto.onnx.ITensorProto[] = [];
  private readonly inputs: onnxProto.onnx.IValueInfoProto[] = [];
  private readonly outputs: onnxProto.onnx.IValueInfoProto[] = [];
  private readonly constants = new Map<string, string>();
  private readonly names = new Set<string>();
  private readonly domains = new Set<string>();
  private counter = 0;
  /** Prefix of generated node names, e.g. `/model/layers.0/self_attn`. */
  scope = '';

  constructor(private readonly graphName: string) {}

  input(name: string, type: ElementType, dims: readonly Dim[]): string {
    this.claim(name);
    this.inputs.push(valueInfo(name, type, dims));
    return name;
  }

  /** Declares `value` (an existing tensor) as the graph output `name`, adding an Identity when they differ. */
  output(value: string, name: string, type: ElementType, dims: readonly Dim[]): void {
    if (value !== name) this.node('Identity', [value], { name });
    this.outputs.push(valueInfo(name, type, dims));
  }

  initializer(name: string, data: Float32Array | BigInt64Array, dims: readonly number[]): string {
    this.claim(name);
    const count = dims.reduce((a, b) => a * b, 1);
    if (count !== data.length) throw new Error(`initializer ${name}: ${data.length} values for dims [${dims.join(', ')}]`);
    this.initializers.push({
      name,
      dims: [...dims],
      dataType: data instanceof Float32Array ? DATA_TYPE.float32 : DATA_TYPE.int64,
      rawData: littleEndianBytes(data),
    });
    return name;
  }

  /** An int64 constant (shared between all nodes that use the same values). */
  int64(values: readonly number[], dims: readonly number[] = [values.length]): string {
    return this.constant(`i64[${dims.join(',')}]:${values.join(',')}`, () => new BigInt64Array(values.map((v) => BigInt(v))), dims);
  }

  /** A float32 constant (shared between all nodes that use the same values). */
  float32(values: readonly number[], dims: readonly number[] = [values.length]): string {
    return this.constant(`f32[${dims.join(',')}]:${values.join(',')}`, () => new Float32Array(values), dims);
  }

  /** Adds a node and returns the names of its outputs. */
  node(opType: string, inputs: readonly string[], options: NodeOptions = {}): string[] {
    const name = options.name ?? `${this.scope}/${opType}_${this.counter++}`;
    const count = options.outputs ?? 1;
    const outputs =
      options.outputNames !== undefined
        ? [...options.outputNames]
        : Array.from({ length: count }, (_, i) => (options.name !== undefined && count === 1 ? name : `${name}_output_${i}`));
    for (const output of outputs) this.claim(output);
    if (options.domain !== undefined) this.domains.add(options.domain);
    this.nodes.push({
      name,
      opType,
      ...(options.domain === undefined ? {} : { domain: options.domain }),
      input: [...inputs],
      output: outputs,
      attribute: Object.entries(options.attributes ?? {}).map(([key, value]) => attributeProto(key, value)),
    });
    return outputs;
  }

  /** Adds a single-output node and returns the name of its output. */
  op(opType: string, inputs: readonly string[], attributes?: Record<string, Attribute>): string {
    const [output] = this.node(opType, inputs, attributes === undefined ? {} : { attributes });
    return output as string;
  }

  /** Serializes the model (IR 8, opset 17). */
  toBytes(info: ModelInfo): Uint8Array {
    const model = onnx.ModelProto.create({
      irVersion: IR_VERSION,
      opsetImport: [{ domain: '', version: OPSET_VERSION }, ...[...this.domains].map((domain) => ({ domain, version: 1 }))],
      producerName: info.producerName,
      producerVersion: info.producerVersion,
      metadataProps: Object.entries(info.metadata ?? {}).map(([key, value]) => ({ key, value })),
      graph: {
        name: this.graphName,
        node: this.nodes,
        initializer: this.initializers,
        input: this.inputs,
        output: this.outputs,
      },
    });
    exactOnnxInt64();
    return onnx.ModelProto.encode(model).finish();
  }

  private constant(key: string, make: () => Float32Array | BigInt64Array, dims: readonly number[]): string {
    const existing = this.constants.get(key);
    if (existing !== undefined) return existing;
    const name = `/const_${this.constants.size}`;
    this.initializer(name, make(), dims);
    this.constants.set(key, name);
    return name;
  }

  private claim(name: string): void {
    if (this.names.has(name)) throw new Error(`duplicate tensor name in ONNX graph: ${name}`);
    this.names.add(name);
  }
}
