import type { TokenLogprobWire } from '@sluice/protocol';
import type { Endpoint } from './request-schemas.js';

const NON_ASCII = /[\u0080-\uffff]/;

/** Whether a string is all ASCII (then its JSON is too, and its UTF-8 byte length is its length). */
export function isAscii(text: string): boolean {
  return !NON_ASCII.test(text);
}

/**
 * Builds the OpenAI response JSON of one request: streamed chunks and the complete (non-stream)
 * object. Chunks are assembled from pre-serialized pieces: this runs once per event per stream, the
 * gateway's hot path, and a template is several times cheaper than JSON.stringify of a fresh object.
 */

/** `abort`: cancelled (`POST .../{id}/cancel`), as vLLM names it. */
export type FinishReason = 'stop' | 'length' | 'abort';

export interface UsageNumbers {
  promptTokens: number;
  completionTokens: number;
}

export interface ChoiceResult {
  index: number;
  text: string;
  logprobs: TokenLogprobWire[] | undefined;
  finishReason: FinishReason | null;
}

function utf8Bytes(text: string): number[] {
  return [...Buffer.from(text, 'utf8')];
}

function chatLogprobs(logprobs: readonly TokenLogprobWire[]) {
  return {
    content: logprobs.map((lp) => ({
      token: lp.token,
      logprob: lp.logprob,
      bytes: lp.bytes ?? utf8Bytes(lp.token),
      top_logprobs: (lp.top ?? []).map((t) => ({ token: t.token, logprob: t.logprob, bytes: t.bytes ?? utf8Bytes(t.token) })),
    })),
  };
}

function usageJson(usage: UsageNumbers) {
  return {
    prompt_tokens: usage.promptTokens,
    completion_tokens: usage.completionTokens,
    total_tokens: usage.promptTokens + usage.completionTokens,
  };
}

/** Options of a response beyond its id and model. */
export interface ResponseFormatOptions {
  /** `system_fingerprint` of every chunk and reply (see `systemFingerprint` in version.ts). */
  fingerprint?: string;
  /** `stream_options.continuous_usage_stats`: every chunk carries the usage so far, read from here. */
  liveUsage?: () => UsageNumbers;
  /** Completions `echo`: the text each choice starts with, by choice index. */
  echo?: readonly string[];
  /**
   * Completions `text_offset`: how far each choice's text (by choice index) had come, beyond its echo,
   * before this response's first token: a resumed stream's count up to its cursor
   * ({@link logprobsTextLength} of the logprobs written before it).
   */
  textBefore?: readonly number[];
}

export class ResponseFormat {
  readonly id: string;
  readonly created: number;
  private readonly head: string;
  /** Every chunk's fixed part (id, model, fingerprint) is ASCII: a chunk is when its text is. */
  readonly asciiHead: boolean;
  private readonly tail: string;
  private readonly deltaPrefixes: string[] = [];
  private readonly deltaSuffix: string;
  /** Completions logprobs carry each token's character offset in the choice's text. */
  private readonly textOffsets = new Map<number, number>();

  constructor(
    readonly endpoint: Endpoint,
    requestId: string,
    readonly model: string,
    private readonly includeUsage: boolean,
    /** The chunks' `created` (s since epoch): a resumed stream keeps the original's. */
    created = Math.floor(Date.now() / 1000),
    private readonly options: ResponseFormatOptions = {},
  ) {
    this.created = created;
    this.id = endpoint === 'chat' ? `chatcmpl-${requestId}` : `cmpl-${requestId}`;
    const object = endpoint === 'chat' ? 'chat.completion.chunk' : 'text_completion';
    const fingerprint = options.fingerprint === undefined ? '' : `"system_fingerprint":${JSON.stringify(options.fingerprint)},`;
    // Each chunk is built whole as one SSE frame: `data: {json}\n\n`.
    this.head = `data: {"id":${JSON.stringify(this.id)},"object":"${object}","created":${this.created},"model":${JSON.stringify(model)},${fingerprint}"choices":[`;
    this.tail = includeUsage || options.liveUsage !== undefined ? '],"usage":null}\n\n' : ']}\n\n';
    this.asciiHead = isAscii(this.head);
    this.deltaSuffix = `${endpoint === 'chat' ? '}' : ''},"logprobs":null,"finish_reason":null}`;
    const choices = Math.max(options.echo?.length ?? 0, options.textBefore?.length ?? 0);
    for (let index = 0; index < choices; index++) {
      this.textOffsets.set(index, codePoints(this.echoText(index)) + (options.textBefore?.[index] ?? 0));
    }
  }

  /** The end of a chunk: its usage (so far, with continuous usage stats) and the frame's end. */
  private end(): string {
    const live = this.options.liveUsage;
    return live === undefined ? this.tail : `],"usage":${JSON.stringify(usageJson(live()))}}\n\n`;
  }

  /** The text a choice starts with: its prompt with `echo`, else nothing. */
  echoText(index: number): string {
    return this.options.echo?.[index] ?? '';
  }

  /**
   * The first chunk of a choice: a chat choice's `delta.role`, a completion's echoed prompt, else none.
   * Each method returns a whole SSE frame.
   */
  roleChunk(index: number): string | undefined {
    if (this.endpoint !== 'chat') {
      const echo = this.echoText(index);
      return echo === '' ? undefined : this.deltaChunk(index, echo, undefined);
    }
    return `${this.head}{"index":${index},"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}${this.end()}`;
  }

  deltaChunk(index: number, text: string, logprobs: readonly TokenLogprobWire[] | undefined): string {
    if (logprobs === undefined) {
      // The common case, once per token per stream: two cached pieces around the text.
      const prefix = (this.deltaPrefixes[index] ??=
        this.endpoint === 'chat' ? `${this.head}{"index":${index},"delta":{"content":` : `${this.head}{"index":${index},"text":`);
      return prefix + JSON.stringify(text) + this.deltaSuffix + this.end();
    }
    const lp = this.logprobsJson(index, logprobs);
    if (this.endpoint === 'chat') {
      return `${this.head}{"index":${index},"delta":{"content":${JSON.stringify(text)}},"logprobs":${lp},"finish_reason":null}${this.end()}`;
    }
    return `${this.head}{"index":${index},"text":${JSON.stringify(text)},"logprobs":${lp},"finish_reason":null}${this.end()}`;
  }

  finishChunk(index: number, finishReason: FinishReason): string {
    if (this.endpoint === 'chat') {
      return `${this.head}{"index":${index},"delta":{},"logprobs":null,"finish_reason":"${finishReason}"}${this.end()}`;
    }
    return `${this.head}{"index":${index},"text":"","logprobs":null,"finish_reason":"${finishReason}"}${this.end()}`;
  }

  /** The `stream_options.include_usage` chunk: no choices, the usage. */
  usageChunk(usage: UsageNumbers): string {
    return `${this.head}],"usage":${JSON.stringify(usageJson(usage))}}\n\n`;
  }

  /** The whole `stream: false` reply, as JSON text (a completion's logprobs keep their order: {@link logprobsJson}). */
  complete(choices: readonly ChoiceResult[], usage: UsageNumbers): string {
    const base = {
      id: this.id,
      created: this.created,
      model: this.model,
      ...(this.options.fingerprint === undefined ? {} : { system_fingerprint: this.options.fingerprint }),
    };
    if (this.endpoint === 'chat') {
      return JSON.stringify({
        ...base,
        object: 'chat.completion',
        choices: choices.map((c) => ({
          index: c.index,
          message: { role: 'assistant', content: c.text, refusal: null },
          logprobs: c.logprobs === undefined ? null : chatLogprobs(c.logprobs),
          finish_reason: c.finishReason,
        })),
        usage: usageJson(usage),
      });
    }
    const head = JSON.stringify({ ...base, object: 'text_completion' }).slice(0, -1);
    const parts = choices.map(
      (c) =>
        `{"index":${c.index},"text":${JSON.stringify(c.text)},"logprobs":${c.logprobs === undefined ? 'null' : this.logprobsJson(c.index, c.logprobs)},"finish_reason":${JSON.stringify(c.finishReason)}}`,
    );
    return `${head},"choices":[${parts.join(',')}],"usage":${JSON.stringify(usageJson(usage))}}`;
  }

  /**
   * A choice's logprobs as JSON text. A completion's `top_logprobs` are objects from token to logprob,
   * most likely first as OpenAI writes them: written by hand, since a JavaScript object lists keys such
   * as "80" or "0" before all others whatever order they were set in.
   */
  private logprobsJson(index: number, logprobs: readonly TokenLogprobWire[]): string {
    if (this.endpoint === 'chat') return JSON.stringify(chatLogprobs(logprobs));
    let offset = this.textOffsets.get(index) ?? 0;
    const textOffset: number[] = [];
    for (const lp of logprobs) {
      textOffset.push(offset);
      offset += codePoints(lp.token);
    }
    this.textOffsets.set(index, offset);
    // OpenAI's top_logprobs hold the sampled token too: up to logprobs + 1 entries (1 for logprobs: 0).
    // Tokens whose text is the same are one key: the first (the likeliest) keeps it.
    const top = logprobs.map((lp) => {
      const seen = new Set<string>();
      const pairs: string[] = [];
      for (const [token, logprob] of [...(lp.top ?? []).map((t) => [t.token, t.logprob] as const), [lp.token, lp.logprob] as const]) {
        if (seen.has(token)) continue;
        seen.add(token);
        pairs.push(`${JSON.stringify(token)}:${JSON.stringify(logprob)}`);
      }
      return `{${pairs.join(',')}}`;
    });
    return (
      `{"tokens":${JSON.stringify(logprobs.map((lp) => lp.token))},"token_logprobs":${JSON.stringify(logprobs.map((lp) => lp.logprob))},` +
      `"top_logprobs":[${top.join(',')}],"text_offset":${JSON.stringify(textOffset)}}`
    );
  }
}

/** How far a completion's logprobs move its `text_offset` on: the characters of their tokens. */
export function logprobsTextLength(logprobs: readonly TokenLogprobWire[]): number {
  let length = 0;
  for (const lp of logprobs) length += codePoints(lp.token);
  return length;
}

/**
 * Characters as OpenAI's `text_offset` counts them (Python's `len`: code points), not UTF-16 units:
 * an emoji is one.
 */
function codePoints(text: string): number {
  let count = 0;
  // A string's iterator steps by code point: a surrogate pair is one step.
  for (const _ of text) count++;
  return count;
}
