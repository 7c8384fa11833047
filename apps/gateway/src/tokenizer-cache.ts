import type { Redis } from 'ioredis';
import type { Logger } from 'pino';
import { ChatTemplateError, loadPromptModel, parsePromptJson, type ChatMessage, type PromptModel } from '@sluice/model';
import { decodeModelCard, type RedisNames } from '@sluice/protocol';
import { GatewayError } from './errors.js';
import { tokenCountBound, type TokenCountBound } from './token-count-bound.js';
import type { ServedModel } from './worker-registry.js';

/**
 * A served model's prompt side at the gateway: tokenizer, chat template and context length, from the
 * model card its workers publish. Used to count and check prompts before the 200, and by
 * `POST /tokenize` / `/detokenize`.
 */
export interface ModelTokenizer {
  /** Max prompt + completion tokens. */
  readonly maxContextLength: number;
  /** Token ids run from 0 to `vocabSize - 1`. */
  readonly vocabSize: number;
  /**
   * The chat rendered with the model's template (with the assistant turn's opening), as token ids.
   * @throws GatewayError `invalid_request` (param `messages`) when the template refuses or fails
   */
  encodeChat(messages: readonly ChatMessage[]): number[];
  /**
   * @param fitsBelow the prompt must have fewer tokens than this: one whose byte length alone proves
   *   it has at least as many is not encoded (seconds for a multi-megabyte prompt), and the result is
   *   that lower bound instead of the ids
   */
  encodeChat(messages: readonly ChatMessage[], fitsBelow: number): number[] | TooManyTokens;
  /** A raw completion prompt as token ids, with the tokenizer's own special tokens (as vLLM does). */
  encodeText(prompt: string): number[];
  /** @param fitsBelow as for {@link encodeChat} */
  encodeText(prompt: string, fitsBelow: number): number[] | TooManyTokens;
  /** Token ids → text (special tokens dropped unless `skipSpecialTokens` is false). */
  decode(ids: readonly number[], options?: { skipSpecialTokens?: boolean }): string;
}

/** A prompt left unencoded: its byte length proves it has at least `atLeast` tokens. */
export interface TooManyTokens {
  atLeast: number;
}

/** Where the gateway gets a model's tokenizer. */
export interface TokenizerSource {
  /** @throws GatewayError `no_workers` when no live worker of the model published a card that loads */
  forModel(model: ServedModel): Promise<ModelTokenizer>;
}

/**
 * Builds a ModelTokenizer from a loaded prompt model.
 * @param bound a lower bound on token counts (see token-count-bound.ts); without one every prompt is encoded
 */
export function modelTokenizer(prompt: PromptModel, maxContextLength: number, bound?: TokenCountBound): ModelTokenizer {
  const { tokenizer, chatTemplate } = prompt;
  /** The ids of `text`, unless its byte length proves it has `fitsBelow` tokens or more. */
  const encodeWithin = (text: string, addSpecialTokens: boolean, fitsBelow: number): number[] | TooManyTokens => {
    if (bound !== undefined && fitsBelow !== Infinity) {
      const atLeast = bound.atLeast(text);
      if (atLeast >= fitsBelow) return { atLeast };
    }
    return tokenizer.encode(text, { addSpecialTokens });
  };
  function encodeChat(messages: readonly ChatMessage[]): number[];
  function encodeChat(messages: readonly ChatMessage[], fitsBelow: number): number[] | TooManyTokens;
  function encodeChat(messages: readonly ChatMessage[], fitsBelow = Infinity): number[] | TooManyTokens {
    let text: string;
    try {
      text = chatTemplate.render(messages, { addGenerationPrompt: true });
    } catch (error) {
      // The template's own raise_exception speaks to the client; anything else stays generic.
      const message =
        error instanceof ChatTemplateError && error.raisedByTemplate
          ? error.message
          : 'The messages cannot be rendered with the model chat template.';
      throw new GatewayError('invalid_request', { message, param: 'messages', cause: error });
    }
    // The template writes the special tokens (BOS, role markers) itself. The bound is taken on the
    // rendered text: a template may add to the messages, or cut them.
    return encodeWithin(text, false, fitsBelow);
  }
  function encodeText(prompt: string): number[];
  function encodeText(prompt: string, fitsBelow: number): number[] | TooManyTokens;
  function encodeText(prompt: string, fitsBelow = Infinity): number[] | TooManyTokens {
    return encodeWithin(prompt, true, fitsBelow);
  }
  return {
    maxContextLength,
    vocabSize: tokenizer.vocabSize,
    encodeChat,
    encodeText,
    decode: (ids, options = {}) => tokenizer.decode(ids, { skipSpecialTokens: options.skipSpecialTokens ?? true }),
  };
}

/**
 * Model cards by content hash, read from Redis once and kept: a card never changes under its hash.
 * Loading runs on the gateway's thread (a real tokenizer takes a few hundred ms, once per hash);
 * `prefetch` does it when the registry first names a hash, so requests rarely wait for it.
 */
export class TokenizerCache implements TokenizerSource {
  private readonly cards = new Map<string, Promise<ModelTokenizer>>();

  constructor(
    private readonly redis: Redis,
    private readonly names: RedisNames,
    private readonly logger: Logger,
  ) {}

  get size(): number {
    return this.cards.size;
  }

  async forModel(model: ServedModel): Promise<ModelTokenizer> {
    if (model.modelCard === undefined) {
      throw new GatewayError('no_workers', { message: `No worker of '${model.id}' published its tokenizer.` });
    }
    return this.load(model.modelCard);
  }

  /** Starts loading a hash in the background (errors are logged; a later request retries). */
  prefetch(hash: string): void {
    if (this.cards.has(hash)) return;
    this.load(hash).catch((error: unknown) => this.logger.warn({ err: error, hash }, 'loading a model card failed'));
  }

  private load(hash: string): Promise<ModelTokenizer> {
    let loading = this.cards.get(hash);
    if (loading === undefined) {
      loading = this.read(hash);
      this.cards.set(hash, loading);
      // A failure is not cached: Redis may be back, or the worker may rewrite its card, by the next try.
      loading.catch(() => this.cards.delete(hash));
    }
    return loading;
  }

  private async read(hash: string): Promise<ModelTokenizer> {
    let raw: string | null;
    try {
      raw = await this.redis.get(this.names.modelCardKey(hash));
    } catch (cause) {
      throw new GatewayError('store_unavailable', { message: 'The model registry is unavailable.', cause });
    }
    const card = raw === null ? undefined : decodeModelCard(raw);
    if (card === undefined) throw new GatewayError('no_workers', { message: 'The model card of this model is missing.' });
    try {
      const started = performance.now();
      // tokenizer.json parsed once for both (10.6 MB for Qwen3's vocabulary: ~0.2 s of this thread).
      const parsed = parsePromptJson(card);
      const bound = tokenCountBound(parsed.tokenizer, parsed.tokenizerConfig);
      const tokenizer = modelTokenizer(loadPromptModel(card, parsed), card.maxContextLength, bound);
      this.logger.info(
        { hash, ms: Math.round(performance.now() - started), maxTokenBytes: bound?.maxTokenBytes ?? null },
        'model card loaded',
      );
      return tokenizer;
    } catch (cause) {
      this.logger.error({ err: cause, hash }, 'model card does not load');
      throw new GatewayError('no_workers', { message: 'The tokenizer of this model cannot be loaded.', cause });
    }
  }
}
