export type * from './types.js';
export { loadModelDir, ModelDirError, type LoadModelDirOptions } from './model-dir.js';
export { loadTokenizer } from './tokenizer.js';
export { createChatTemplate, ChatTemplateError } from './chat-template.js';
export {
  readPromptFiles,
  loadPromptModel,
  parsePromptJson,
  type ParsedPromptJson,
  type PromptFiles,
  type PromptModel,
} from './prompt-files.js';
export { readOnnxIo, USE_CACHE_BRANCH } from './onnx-io.js';
export { exactOnnxInt64 } from './onnx-proto.js';
export { readOnnxGraphOnly } from './onnx-graph-only.js';
export { TextStreamer, type TextStreamerOptions } from './text-streamer.js';
export { generateTinyModel, type GenerateTinyModelOptions } from './tiny-model/generate-tiny-model.js';
export type { AttentionForm } from './tiny-model/llama-graph.js';
export { ensureBuiltinModel, defaultModelsRoot } from './tiny-model/ensure-builtin-model.js';
export { writeTinyModelGguf } from './tiny-model/llama-gguf.js';
