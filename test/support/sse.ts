/** Reading an SSE response raw, as bytes arrive, for checks the official client hides. */

export type SseItem =
  /** `id`: the event's `id:` field (the stream cursor), when it has one. */
  | { kind: 'data'; data: string; at: number; id?: string }
  | { kind: 'comment'; text: string; at: number }
  | { kind: 'other'; line: string; at: number };

/** Parses an SSE body into items (data events and comment lines) with their arrival times. */
export async function* readSse(body: ReadableStream<Uint8Array>): AsyncGenerator<SseItem> {
  const decoder = new TextDecoder();
  let buffer = '';
  let data: string[] = [];
  let id: string | undefined;
  for await (const chunk of body as unknown as AsyncIterable<Uint8Array>) {
    const at = Date.now();
    buffer += decoder.decode(chunk, { stream: true });
    let newline: number;
    while ((newline = buffer.indexOf('\n')) >= 0) {
      const line = buffer.slice(0, newline).replace(/\r$/, '');
      buffer = buffer.slice(newline + 1);
      if (line === '') {
        if (data.length > 0) yield { kind: 'data', data: data.join('\n'), at, ...(id === undefined ? {} : { id }) };
        data = [];
        id = undefined;
      } else if (line.startsWith('id:')) {
        id = line.slice(3).replace(/^ /, '');
      } else if (line.startsWith(':')) {
        yield { kind: 'comment', text: line.slice(1).trim(), at };
      } else if (line.startsWith('data:')) {
        data.push(line.slice(5).replace(/^ /, ''));
      } else {
        yield { kind: 'other', line, at };
      }
    }
  }
}

export async function collectSse(body: ReadableStream<Uint8Array>): Promise<SseItem[]> {
  const items: SseItem[] = [];
  for await (const item of readSse(body)) items.push(item);
  return items;
}

export interface PostResult {
  status: number;
  headers: Headers;
  items: SseItem[];
  /** Parsed JSON when the reply was not SSE. */
  json?: unknown;
}

/** POSTs a JSON body and reads the whole reply (SSE items or JSON). */
export async function postRaw(url: string, body: unknown, init: { signal?: AbortSignal } = {}): Promise<PostResult> {
  const res = await fetch(url, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: typeof body === 'string' ? body : JSON.stringify(body),
    ...(init.signal === undefined ? {} : { signal: init.signal }),
  });
  if (res.headers.get('content-type')?.startsWith('text/event-stream') === true && res.body !== null) {
    return { status: res.status, headers: res.headers, items: await collectSse(res.body) };
  }
  return { status: res.status, headers: res.headers, items: [], json: await res.json() };
}

interface ChunkJson {
  id: string;
  object: string;
  created: number;
  model: string;
  choices: Array<{
    index: number;
    delta?: { role?: string; content?: string };
    text?: string;
    finish_reason: string | null;
    logprobs: unknown;
  }>;
  usage?: { prompt_tokens: number; completion_tokens: number; total_tokens: number } | null;
  error?: unknown;
}

export interface CheckedStream {
  text: string;
  finishReason: string;
  usage: ChunkJson['usage'];
  contentChunks: number;
  pings: number;
}

/**
 * Checks the exact OpenAI chunk sequence of a one-choice stream and returns its text:
 * [role chunk (chat)], content chunks, one finish chunk, [usage chunk], `[DONE]`, nothing after.
 * Throws with a description of the first deviation.
 */
export function checkChunkSequence(items: readonly SseItem[], endpoint: 'chat' | 'completion', includeUsage: boolean): CheckedStream {
  const data = items.filter((i): i is Extract<SseItem, { kind: 'data' }> => i.kind === 'data').map((i) => i.data);
  const fail = (why: string): never => {
    throw new Error(`${why}\nstream:\n${data.join('\n')}`);
  };
  if (items.some((i) => i.kind === 'other')) fail('a line that is neither data nor comment (named event?)');
  if (data.at(-1) !== '[DONE]') fail('does not end with [DONE]');
  const chunks = data.slice(0, -1).map((d) => JSON.parse(d) as ChunkJson);
  if (chunks.some((c) => c.error !== undefined)) fail('error frame');
  const object = endpoint === 'chat' ? 'chat.completion.chunk' : 'text_completion';
  const first = chunks[0];
  if (first === undefined) return fail('no chunks');
  for (const c of chunks) {
    if (c.object !== object || c.id !== first.id || c.created !== first.created || c.model !== first.model)
      fail('inconsistent id/object/created/model');
    if (includeUsage !== 'usage' in c) fail(includeUsage ? 'a chunk without "usage"' : 'a chunk with "usage"');
  }
  let i = 0;
  if (endpoint === 'chat') {
    const role = chunks[i++];
    if (role?.choices[0]?.delta?.role !== 'assistant' || role.choices[0].delta.content !== '' || role.choices[0].finish_reason !== null)
      fail('first chunk is not the role chunk');
  }
  let text = '';
  let contentChunks = 0;
  for (; i < chunks.length; i++) {
    const choice = chunks[i]?.choices[0];
    if (choice === undefined || choice.finish_reason !== null) break;
    if (endpoint === 'chat') {
      if (choice.delta?.role !== undefined || typeof choice.delta?.content !== 'string') fail('content chunk shape');
      text += choice.delta?.content ?? '';
    } else {
      if (typeof choice.text !== 'string') fail('content chunk shape');
      text += choice.text ?? '';
    }
    contentChunks++;
  }
  const finish = chunks[i++];
  const finishChoice = finish?.choices[0];
  if (finishChoice?.finish_reason !== 'stop' && finishChoice?.finish_reason !== 'length') return fail('missing finish chunk');
  if (endpoint === 'chat' && JSON.stringify(finishChoice.delta) !== '{}') fail('finish chunk delta is not empty');
  if (includeUsage && finish?.usage !== null) fail('usage before the usage chunk');
  let usage: ChunkJson['usage'] = undefined;
  if (includeUsage) {
    const usageChunk = chunks[i++];
    if (usageChunk === undefined || usageChunk.choices.length !== 0 || usageChunk.usage === null || usageChunk.usage === undefined)
      fail('missing usage chunk');
    usage = usageChunk?.usage;
  }
  if (i !== chunks.length) fail('chunks after the finish/usage chunk');
  return {
    text,
    finishReason: finishChoice.finish_reason,
    usage,
    contentChunks,
    pings: items.filter((item) => item.kind === 'comment' && item.text === 'ping').length,
  };
}

/** The error frame of a stream that ended with `data: {"error":...}` then `[DONE]`. */
export function streamError(items: readonly SseItem[]): { code: string; message: string; type: string } | undefined {
  const data = items.filter((i): i is Extract<SseItem, { kind: 'data' }> => i.kind === 'data').map((i) => i.data);
  if (data.at(-1) !== '[DONE]') return undefined;
  const last = data.at(-2);
  if (last === undefined) return undefined;
  const parsed = JSON.parse(last) as { error?: { code: string; message: string; type: string } };
  return parsed.error;
}

/**
 * A stream read in the background: its items as they arrive, a way to wait for progress, to abort
 * like a client that goes away, and a promise of how it ended.
 */
export class LiveStream {
  readonly items: SseItem[] = [];
  status = 0;
  /** The gateway's request id (X-Request-Id), once headers arrived. */
  requestId: string | null = null;
  readonly controller = new AbortController();
  /** When the request was sent (ms since the epoch). */
  readonly startedAt = Date.now();
  /** Resolves when the body ended (or the fetch failed / was aborted). */
  readonly ended: Promise<'done' | 'aborted' | 'failed'>;
  /** Resolves with the response status once headers arrive. */
  readonly headers: Promise<number>;
  private waiters: Array<() => void> = [];

  /** @param headers sent besides `Content-Type` (an API key) */
  constructor(url: string, body: unknown, headers: Record<string, string> = {}) {
    let gotHeaders!: (status: number) => void;
    this.headers = new Promise((resolve) => (gotHeaders = resolve));
    this.ended = (async () => {
      try {
        const res = await fetch(url, {
          method: 'POST',
          headers: { 'Content-Type': 'application/json', ...headers },
          body: JSON.stringify(body),
          signal: this.controller.signal,
        });
        this.status = res.status;
        this.requestId = res.headers.get('x-request-id');
        gotHeaders(res.status);
        if (res.body === null) return 'done';
        if (res.headers.get('content-type')?.startsWith('text/event-stream') !== true) {
          this.items.push({ kind: 'other', line: await res.text(), at: Date.now() });
          return 'done';
        }
        for await (const item of readSse(res.body)) {
          this.items.push(item);
          this.notify();
        }
        return 'done';
      } catch (error) {
        gotHeaders(0);
        return this.controller.signal.aborted ? 'aborted' : (String(error), 'failed');
      } finally {
        this.notify();
      }
    })();
  }

  /** Content chunks so far (data events other than the role chunk, finish, usage, error, [DONE]). */
  get contentChunks(): number {
    let count = 0;
    for (const item of this.items) {
      if (item.kind !== 'data' || item.data === '[DONE]') continue;
      const chunk = JSON.parse(item.data) as { choices?: Array<{ delta?: { content?: string }; text?: string; finish_reason: unknown }> };
      const choice = chunk.choices?.[0];
      if (choice !== undefined && choice.finish_reason === null && ((choice.delta?.content ?? '') !== '' || (choice.text ?? '') !== ''))
        count++;
    }
    return count;
  }

  /**
   * The gateway's job id: the `{id}` of the chunks' `cmpl-{id}` / `chatcmpl-{id}`, which keys the
   * request's token log (the x-request-id is the client's own when it sent one, as nginx does).
   */
  get jobId(): string {
    for (const item of this.items) {
      if (item.kind !== 'data' || item.data === '[DONE]') continue;
      const id = (JSON.parse(item.data) as { id?: unknown }).id;
      if (typeof id === 'string') return id.replace(/^(chat)?cmpl-/, '');
    }
    throw new Error('the stream has no chunk with an id yet');
  }

  get pings(): number {
    return this.items.filter((item) => item.kind === 'comment' && item.text === 'ping').length;
  }

  /** Waits until `predicate` holds, checked on every item; throws after `timeoutMs`. */
  async until(what: string, predicate: () => boolean, timeoutMs = 20_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    let finished = false;
    void this.ended.then(() => (finished = true));
    while (!predicate()) {
      if (finished) throw new Error(`stream ended before ${what}`);
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`timed out waiting for ${what}`);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, Math.min(left, 100));
        this.waiters.push(() => {
          clearTimeout(timer);
          resolve();
        });
      });
    }
  }

  abort(): void {
    this.controller.abort();
  }

  private notify(): void {
    const waiters = this.waiters;
    this.waiters = [];
    for (const resolve of waiters) resolve();
  }
}

/** What a test read off an SSE reply of ours ({@link read}). */
export interface Collected {
  id: string | undefined;
  /** Choice 0's text. */
  text: string;
  /** How many chunks carried text (any choice's). */
  textChunks: number;
  lastEventId: string | undefined;
  finishReasons: Record<number, string>;
  errors: unknown[];
  done: boolean;
}

export const empty = (): Collected => ({
  id: undefined,
  text: '',
  textChunks: 0,
  lastEventId: undefined,
  finishReasons: {},
  errors: [],
  done: false,
});

/** An SSE reply's items, read on by each {@link read} (the body stays open between reads). */
const itemsOf = new WeakMap<Response, AsyncGenerator<SseItem>>();

/** Reads an SSE reply into `into` until `[DONE]`, the end of the body, or `until(into)` (a later read goes on from there). */
export async function read(res: Response, into: Collected, until?: (c: Collected) => boolean): Promise<void> {
  let items = itemsOf.get(res);
  if (items === undefined) itemsOf.set(res, (items = readSse(res.body!)));
  try {
    for (let next = await items.next(); next.done !== true; next = await items.next()) {
      const item = next.value;
      if (item.kind !== 'data') continue;
      if (item.id !== undefined) into.lastEventId = item.id;
      if (item.data === '[DONE]') {
        into.done = true;
        return;
      }
      const chunk = JSON.parse(item.data) as {
        id?: string;
        error?: unknown;
        choices?: Array<{ index: number; delta?: { content?: string }; text?: string; finish_reason?: string | null }>;
      };
      if (chunk.error !== undefined) into.errors.push(chunk.error);
      into.id ??= chunk.id;
      if (chunk.choices?.some((choice) => (choice.delta?.content ?? choice.text ?? '') !== '') === true) into.textChunks++;
      for (const choice of chunk.choices ?? []) {
        if (choice.index === 0) into.text += choice.delta?.content ?? choice.text ?? '';
        if (choice.finish_reason) into.finishReasons[choice.index] = choice.finish_reason;
      }
      if (until?.(into) === true) return;
    }
  } catch (error) {
    // The connection was cut under us (the test aborted it).
    if (!(error instanceof Error)) throw error;
  }
}

/** Reads a whole SSE reply. */
export async function collect(res: Response): Promise<Collected> {
  const out = empty();
  await read(res, out);
  return out;
}
