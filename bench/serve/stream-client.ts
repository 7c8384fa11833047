/**
 * One streamed completion as a client sees it, against any OpenAI-compatible server
 * (`POST /v1/completions`, `stream: true`): when it was sent, when each text chunk arrived, the text
 * and the finish reason. The same code reads Sluice and the peer, so both are timed alike.
 */

export interface StreamedCompletion {
  /** `performance.now()` when the request was sent. */
  sentAt: number;
  /** `performance.now()` when each chunk carrying text (a token's text) arrived. */
  textAt: number[];
  text: string;
  finishReason: string | null;
}

interface CompletionChunk {
  choices?: Array<{ text?: string; finish_reason?: string | null }>;
}

/** Streams one completion; `body` is sent as is with `stream: true`. Throws on an HTTP error or a stream that ends without a finish reason. */
export async function streamCompletion(url: string, body: Record<string, unknown>): Promise<StreamedCompletion> {
  try {
    return await stream(url, body);
  } catch (error) {
    throw new Error(`${url}/v1/completions failed: ${(error as Error).message}`, { cause: error });
  }
}

async function stream(url: string, body: Record<string, unknown>): Promise<StreamedCompletion> {
  let sentAt = performance.now();
  const send = () =>
    fetch(`${url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ ...body, stream: true }),
    });
  let res: Response;
  try {
    res = await send();
  } catch {
    // A kept-alive connection the server closed as the request went out (llama-server closes idle
    // ones after 5 s): no answer was started, so send it again, timed from the new send.
    sentAt = performance.now();
    res = await send();
  }
  if (!res.ok || res.body === null) throw new Error(`${url}: HTTP ${res.status} ${await res.text()}`);
  const result: StreamedCompletion = { sentAt, textAt: [], text: '', finishReason: null };
  const decoder = new TextDecoder();
  let buffered = '';
  for await (const bytes of res.body as unknown as AsyncIterable<Uint8Array>) {
    const now = performance.now();
    buffered += decoder.decode(bytes, { stream: true });
    let end: number;
    while ((end = buffered.indexOf('\n\n')) !== -1) {
      const frame = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of frame.split('\n')) {
        if (!line.startsWith('data:')) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') continue;
        const chunk = JSON.parse(data) as CompletionChunk & { error?: unknown };
        if (chunk.error !== undefined) throw new Error(`${url}: stream error ${JSON.stringify(chunk.error)}`);
        const choice = chunk.choices?.[0];
        if (choice === undefined) continue;
        if (choice.text !== undefined && choice.text !== '') {
          result.text += choice.text;
          result.textAt.push(now);
        }
        if (choice.finish_reason !== undefined && choice.finish_reason !== null) result.finishReason = choice.finish_reason;
      }
    }
  }
  if (result.finishReason === null) throw new Error(`${url}: the stream ended without a finish reason`);
  return result;
}
