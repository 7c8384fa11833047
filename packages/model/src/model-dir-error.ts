/**
 * A model directory, or one of its files, is missing or malformed. The message names the file
 * (relative to the directory) and what is wrong: `config.json: num_hidden_layers must be a
 * positive integer`, `onnx/model.onnx: file not found`.
 */
export class ModelDirError extends Error {
  override readonly name = 'ModelDirError';

  constructor(
    /** The offending file, relative to the model directory (or the directory itself). */
    readonly file: string,
    /** What is wrong with it. */
    readonly problem: string,
    options?: ErrorOptions,
  ) {
    super(`${file}: ${problem}`, options);
  }
}
