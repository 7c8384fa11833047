#!/usr/bin/env node
/**
 * `npm run model:generate -- --preset tiny|bench --out <dir> [--seed <n>] [--attention plain|gqa|gqa-fused|sdpa] [--external-data] [--merged]`
 * `npm run model:generate -- --preset tiny|bench --format gguf --out <file.gguf> [--seed <n>]`
 *
 * Writes a built-in random Llama model directory (config, tokenizer, onnx/model.onnx, and with
 * `--external-data` its weights in onnx/model.onnx_data, as large exports come; with `--merged` the
 * decoder laid out as Optimum's `decoder_model_merged.onnx`, one `If` on `use_cache_branch`), or the same
 * weights and tokenizer as one GGUF file for llama.cpp (the peer of `npm run bench:serve`).
 * Without `--out`, makes sure the default copy (`models/<preset>`, as workers and tests use it) is
 * there and current, generating it only when it is missing or stale (`npm run build` does this).
 */
import { stat } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { buildTinyModelFiles, DEFAULT_SEED, writeTinyModelFiles } from '../tiny-model/generate-tiny-model.js';
import { defaultModelsRoot, ensureBuiltinModel } from '../tiny-model/ensure-builtin-model.js';
import { writeTinyModelGguf } from '../tiny-model/llama-gguf.js';
import { isTinyModelPreset, TINY_MODEL_PRESETS } from '../tiny-model/presets.js';
import type { AttentionForm } from '../tiny-model/llama-graph.js';
import { describeFsError } from './describe-fs-error.js';

const USAGE = `Usage: npm run model:generate -- --preset <${Object.keys(TINY_MODEL_PRESETS).join('|')}> [--out <dir>] [--seed <n>] [--attention plain|gqa|gqa-fused|sdpa] [--external-data] [--merged] [--format onnx|gguf]`;

class UsageError extends Error {}

interface GenerateArgs {
  preset: keyof typeof TINY_MODEL_PRESETS;
  out: string | undefined;
  seed: number;
  attention: AttentionForm;
  externalData: boolean;
  merged: boolean;
  format: 'onnx' | 'gguf';
}

function parse(argv: string[]): GenerateArgs | 'help' {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        preset: { type: 'string' },
        out: { type: 'string' },
        seed: { type: 'string' },
        attention: { type: 'string' },
        format: { type: 'string' },
        'external-data': { type: 'boolean' },
        merged: { type: 'boolean' },
        help: { type: 'boolean', short: 'h' },
      },
      strict: true,
      allowPositionals: false,
    }));
  } catch (error) {
    throw new UsageError((error as Error).message);
  }
  if (values.help === true) return 'help';
  const presetNames = Object.keys(TINY_MODEL_PRESETS).join(', ');
  if (values.preset === undefined) throw new UsageError(`--preset is required (one of: ${presetNames})`);
  if (!isTinyModelPreset(values.preset)) {
    throw new UsageError(`--preset must be one of: ${presetNames} (got ${JSON.stringify(values.preset)})`);
  }
  if (values.out === '') throw new UsageError('--out must name the directory to write the model into');
  let seed = DEFAULT_SEED;
  if (values.seed !== undefined) {
    seed = Number(values.seed);
    if (!/^\d+$/.test(values.seed) || !Number.isSafeInteger(seed) || seed > 0xffff_ffff) {
      throw new UsageError(`--seed must be an integer from 0 to 4294967295 (got ${JSON.stringify(values.seed)})`);
    }
  }
  if (values.out === undefined && values.seed !== undefined)
    throw new UsageError('--seed needs --out (the default copy uses the default seed)');
  const attention = values.attention ?? 'plain';
  if (attention !== 'plain' && attention !== 'gqa' && attention !== 'gqa-fused' && attention !== 'sdpa')
    throw new UsageError(`--attention must be plain, gqa, gqa-fused or sdpa (got ${JSON.stringify(attention)})`);
  if (values.out === undefined && attention !== 'plain')
    throw new UsageError('--attention needs --out (the default copy uses the plain form)');
  const format = values.format ?? 'onnx';
  if (format !== 'onnx' && format !== 'gguf') throw new UsageError(`--format must be onnx or gguf (got ${JSON.stringify(format)})`);
  if (format === 'gguf' && values.out === undefined) throw new UsageError('--format gguf needs --out (the file to write)');
  if (format === 'gguf' && attention !== 'plain') throw new UsageError('--attention is for the ONNX graph; a GGUF file has none');
  const externalData = values['external-data'] === true;
  if (externalData && values.out === undefined)
    throw new UsageError('--external-data needs --out (the default copy keeps its weights in model.onnx)');
  if (externalData && format === 'gguf') throw new UsageError('--external-data is for the ONNX files; a GGUF file holds its weights');
  const merged = values.merged === true;
  if (merged && values.out === undefined) throw new UsageError('--merged needs --out (the default copy is a plain decoder)');
  if (merged && format === 'gguf') throw new UsageError('--merged is for the ONNX graph; a GGUF file has none');
  return {
    preset: values.preset,
    out: values.out === undefined ? undefined : resolve(values.out),
    seed,
    attention,
    externalData,
    merged,
    format,
  };
}

async function main(): Promise<void> {
  let args;
  try {
    args = parse(process.argv.slice(2));
  } catch (error) {
    if (!(error instanceof UsageError)) throw error;
    process.stderr.write(`model:generate: ${error.message}\n${USAGE}\n`);
    process.exitCode = 2;
    return;
  }
  if (args === 'help') {
    process.stdout.write(`${USAGE}\n`);
    return;
  }

  try {
    await generate(args);
  } catch (error) {
    // Out of room, a read-only or missing place: one line, not a stack.
    const failure = describeFsError(error, args.out ?? join(defaultModelsRoot(), args.preset));
    if (failure === undefined) throw error;
    process.stderr.write(`model:generate: ${failure}\n`);
    process.exitCode = 1;
  }
}

async function generate(args: GenerateArgs): Promise<void> {
  if (args.out === undefined) {
    process.stdout.write(`The built-in ${args.preset} model is at ${await ensureBuiltinModel(args.preset)}\n`);
    return;
  }
  const started = performance.now();
  if (args.format === 'gguf') {
    await writeTinyModelGguf(args.out, args.preset, args.seed);
    const seconds = (performance.now() - started) / 1000;
    const bytes = (await stat(args.out)).size;
    process.stdout.write(
      `Wrote the ${args.preset} model to ${args.out} in ${seconds.toFixed(1)} s: GGUF, ${(bytes / 2 ** 20).toFixed(1)} MiB\n`,
    );
    return;
  }
  const { files, parameters, architecture } = buildTinyModelFiles(args.preset, args.seed, args);
  await writeTinyModelFiles(files, args.out);
  const seconds = (performance.now() - started) / 1000;
  let onnxBytes = 0;
  for (const path of files.keys()) if (path.startsWith('onnx/')) onnxBytes += (await stat(join(args.out, path))).size;
  process.stdout.write(
    `Wrote the ${args.preset} model to ${args.out} in ${seconds.toFixed(1)} s: ` +
      `${parameters.toLocaleString('en-US')} parameters, ${architecture.numLayers} layers, ` +
      `vocab ${architecture.vocabSize}, ${args.attention} attention${args.merged ? ', merged decoder' : ''}, ` +
      `${args.externalData ? 'onnx/model.onnx + model.onnx_data' : 'onnx/model.onnx'} ${(onnxBytes / 2 ** 20).toFixed(1)} MiB\n`,
  );
}

await main();
