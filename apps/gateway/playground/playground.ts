/**
 * The playground page at `/`: a chat that streams through the public API with `fetch`, the way a
 * client application would. No framework: a few DOM nodes and one SSE reader.
 *
 * - Stop aborts the fetch and cancels the request by id (`POST .../{id}/cancel`): with a resume grace
 *   the gateway would otherwise keep the request running for a resume.
 * - A dropped connection (not a stop) is resumed with `GET /v1/chat/completions/{id}?stream=true` and
 *   `Last-Event-ID: <the last id: seen>`, from whichever gateway answers.
 * - Token counts come from `stream_options.continuous_usage_stats` (usage on every chunk).
 */

interface ChatMessage {
  role: 'system' | 'user' | 'assistant';
  content: string;
}

interface SseEvent {
  id: string | undefined;
  data: string;
}

interface Run {
  controller: AbortController;
  stopped: boolean;
  startedAt: number;
  firstTokenAt: number | undefined;
  lastTokenAt: number | undefined;
  tokens: number;
  text: string;
  /** The chunks' `id`: what resume and cancel address. */
  id: string | undefined;
  /** The last `id:` seen: where a resume starts. */
  cursor: string | undefined;
  done: boolean;
  resumes: number;
}

const MAX_RESUMES = 5;
const MAX_FRAMES = 400;

const byId = <T extends HTMLElement>(id: string): T => {
  const element = document.getElementById(id);
  if (element === null) throw new Error(`#${id} is missing`);
  return element as T;
};

const ui = {
  model: byId<HTMLSelectElement>('model'),
  apiKey: byId<HTMLInputElement>('api-key'),
  transcript: byId<HTMLDivElement>('transcript'),
  composer: byId<HTMLFormElement>('composer'),
  message: byId<HTMLTextAreaElement>('message'),
  send: byId<HTMLButtonElement>('send'),
  stop: byId<HTMLButtonElement>('stop'),
  clear: byId<HTMLButtonElement>('clear'),
  ttft: byId<HTMLElement>('ttft'),
  tokens: byId<HTMLElement>('tokens'),
  tps: byId<HTMLElement>('tps'),
  finish: byId<HTMLElement>('finish'),
  resumes: byId<HTMLElement>('resumes'),
  requestId: byId<HTMLElement>('request-id'),
  status: byId<HTMLElement>('status'),
  frames: byId<HTMLPreElement>('frames'),
  system: byId<HTMLTextAreaElement>('system'),
  temperature: byId<HTMLInputElement>('temperature'),
  topP: byId<HTMLInputElement>('top_p'),
  topK: byId<HTMLInputElement>('top_k'),
  maxTokens: byId<HTMLInputElement>('max_tokens'),
  seed: byId<HTMLInputElement>('seed'),
  stopSeq: byId<HTMLInputElement>('stop_seq'),
  ignoreEos: byId<HTMLInputElement>('ignore_eos'),
  resumeGrace: byId<HTMLInputElement>('resume_grace'),
};

const history: ChatMessage[] = [];
let current: Run | undefined;

function setStatus(text: string): void {
  ui.status.textContent = text;
}

/** Request headers: JSON, and the API key when one is typed (kept in this browser only). */
function headers(extra: Record<string, string> = {}): Record<string, string> {
  const out: Record<string, string> = { ...extra };
  const key = ui.apiKey.value.trim();
  if (key !== '') out.Authorization = `Bearer ${key}`;
  return out;
}

async function errorText(res: Response): Promise<string> {
  try {
    const body = (await res.json()) as { error?: { message?: string } };
    return `${res.status}: ${body.error?.message ?? res.statusText}`;
  } catch {
    return `${res.status} ${res.statusText}`;
  }
}

/** Fills the model list; a failure (the gateway unreachable) shows in the status line instead of escaping. */
function refreshModels(): void {
  loadModels().catch((error: unknown) => setStatus(`Models: ${error instanceof Error ? error.message : String(error)}`));
}

async function loadModels(): Promise<void> {
  const res = await fetch('/v1/models', { headers: headers() });
  if (!res.ok) {
    setStatus(`Models: ${await errorText(res)}`);
    return;
  }
  const body = (await res.json()) as { data: Array<{ id: string; max_model_len?: number }> };
  const selected = ui.model.value;
  ui.model.replaceChildren(
    ...body.data.map((model) => {
      const option = document.createElement('option');
      option.value = model.id;
      option.textContent = model.max_model_len === undefined ? model.id : `${model.id} (${model.max_model_len} tokens)`;
      return option;
    }),
  );
  if (body.data.some((m) => m.id === selected)) ui.model.value = selected;
  if (body.data.length === 0) setStatus('No live worker serves a model yet.');
}

function addTurn(role: ChatMessage['role'], text: string): HTMLElement {
  const turn = document.createElement('div');
  turn.className = `turn ${role}`;
  const who = document.createElement('span');
  who.className = 'who';
  who.textContent = role;
  const body = document.createElement('span');
  body.className = 'text';
  body.textContent = text;
  turn.append(who, body);
  ui.transcript.append(turn);
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
  return body;
}

function logFrame(text: string): void {
  const line = document.createTextNode(`${text}\n`);
  ui.frames.append(line);
  while (ui.frames.childNodes.length > MAX_FRAMES) ui.frames.firstChild?.remove();
}

/** The SSE events of a fetch body, as they arrive (comments skipped, `id:` kept). */
async function* readEvents(res: Response, log: (frame: string) => void): AsyncGenerator<SseEvent> {
  if (res.body === null) return;
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end: number;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, '');
      log(frame);
      let id: string | undefined;
      const data: string[] = [];
      for (const line of frame.split(/\r?\n/)) {
        if (line.startsWith('id:')) id = line.slice(3).trim();
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
      }
      if (data.length > 0) yield { id, data: data.join('\n') };
    }
  }
}

function showStats(run: Run): void {
  ui.tokens.textContent = String(run.tokens);
  if (run.firstTokenAt !== undefined) ui.ttft.textContent = `${Math.round(run.firstTokenAt - run.startedAt)} ms`;
  if (run.firstTokenAt !== undefined && run.lastTokenAt !== undefined && run.tokens > 1 && run.lastTokenAt > run.firstTokenAt) {
    // Decode speed: tokens after the first over the time since the first.
    ui.tps.textContent = ((run.tokens - 1) / ((run.lastTokenAt - run.firstTokenAt) / 1000)).toFixed(1);
  }
  ui.resumes.textContent = String(run.resumes);
}

interface Chunk {
  id?: string;
  choices?: Array<{ delta?: { content?: string }; finish_reason?: string | null }>;
  usage?: { completion_tokens: number } | null;
  error?: { message: string };
}

/** Reads one response of the run; resolves once `[DONE]` arrived, throws when the stream broke off. */
async function consume(res: Response, run: Run, out: HTMLElement): Promise<void> {
  for await (const event of readEvents(res, logFrame)) {
    if (event.id !== undefined) run.cursor = event.id;
    if (event.data === '[DONE]') {
      run.done = true;
      return;
    }
    const chunk = JSON.parse(event.data) as Chunk;
    if (chunk.error !== undefined) {
      const error = document.createElement('span');
      error.className = 'error';
      error.textContent = ` [${chunk.error.message}]`;
      out.after(error);
      continue;
    }
    if (chunk.id !== undefined && run.id === undefined) {
      run.id = chunk.id;
      ui.requestId.textContent = chunk.id;
    }
    const choice = chunk.choices?.[0];
    const text = choice?.delta?.content ?? '';
    const now = performance.now();
    if (text !== '') {
      run.firstTokenAt ??= now;
      run.lastTokenAt = now;
      run.text += text;
      out.textContent = run.text;
      ui.transcript.scrollTop = ui.transcript.scrollHeight;
    }
    if (chunk.usage !== undefined && chunk.usage !== null) run.tokens = chunk.usage.completion_tokens;
    if (choice?.finish_reason) ui.finish.textContent = choice.finish_reason;
    showStats(run);
  }
  throw new Error('the stream ended before [DONE]');
}

function numberField(input: HTMLInputElement): number | undefined {
  return input.value.trim() === '' ? undefined : Number(input.value);
}

function requestBody(): Record<string, unknown> {
  const system = ui.system.value.trim();
  const body: Record<string, unknown> = {
    model: ui.model.value,
    messages: [...(system === '' ? [] : [{ role: 'system', content: system }]), ...history],
    stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true },
    temperature: numberField(ui.temperature),
    top_p: numberField(ui.topP),
    top_k: numberField(ui.topK),
    max_tokens: numberField(ui.maxTokens),
    seed: numberField(ui.seed),
    resume_grace_ms: numberField(ui.resumeGrace),
  };
  if (ui.stopSeq.value !== '') body.stop = ui.stopSeq.value;
  if (ui.ignoreEos.checked) body.ignore_eos = true;
  return body;
}

async function send(text: string): Promise<void> {
  history.push({ role: 'user', content: text });
  addTurn('user', text);
  const out = addTurn('assistant', '');
  const run: Run = {
    controller: new AbortController(),
    stopped: false,
    startedAt: performance.now(),
    firstTokenAt: undefined,
    lastTokenAt: undefined,
    tokens: 0,
    text: '',
    id: undefined,
    cursor: undefined,
    done: false,
    resumes: 0,
  };
  current = run;
  for (const field of [ui.ttft, ui.tokens, ui.tps, ui.finish, ui.requestId]) field.textContent = '–';
  ui.resumes.textContent = '0';
  ui.send.disabled = true;
  ui.stop.disabled = false;
  setStatus('Waiting for the first token…');
  try {
    let res = await fetch('/v1/chat/completions', {
      method: 'POST',
      headers: headers({ 'Content-Type': 'application/json' }),
      body: JSON.stringify(requestBody()),
      signal: run.controller.signal,
    });
    if (!res.ok) throw new Error(await errorText(res));
    for (;;) {
      try {
        await consume(res, run, out);
        break;
      } catch (error) {
        if (run.stopped) break;
        // A dropped connection: resume after the last event received, a little later each time.
        if (run.id === undefined || run.resumes >= MAX_RESUMES) throw error;
        run.resumes++;
        showStats(run);
        setStatus(`Connection lost; resuming after event ${run.cursor ?? '(none)'}…`);
        await new Promise((resolve) => setTimeout(resolve, 250 * run.resumes));
        run.controller = new AbortController();
        res = await fetch(`/v1/chat/completions/${encodeURIComponent(run.id)}?stream=true`, {
          headers: headers(run.cursor === undefined ? {} : { 'Last-Event-ID': run.cursor }),
          signal: run.controller.signal,
        });
        if (!res.ok) throw new Error(`resume: ${await errorText(res)}`);
      }
    }
    setStatus(run.stopped ? 'Stopped.' : 'Done.');
  } catch (error) {
    if (!run.stopped) {
      setStatus(error instanceof Error ? error.message : String(error));
      const failure = document.createElement('span');
      failure.className = 'error';
      failure.textContent = ` [${error instanceof Error ? error.message : String(error)}]`;
      out.after(failure);
    } else {
      setStatus('Stopped.');
    }
  } finally {
    history.push({ role: 'assistant', content: run.text });
    if (current === run) current = undefined;
    ui.send.disabled = false;
    ui.stop.disabled = true;
  }
}

/** Stop: abort the fetch, and cancel by id (a request with a resume grace outlives its connection). */
function stop(): void {
  const run = current;
  if (run === undefined) return;
  run.stopped = true;
  run.controller.abort();
  if (run.id !== undefined) {
    void fetch(`/v1/chat/completions/${encodeURIComponent(run.id)}/cancel`, { method: 'POST', headers: headers() }).catch(() => undefined);
  }
  ui.finish.textContent = 'stopped';
}

ui.composer.addEventListener('submit', (event) => {
  event.preventDefault();
  const text = ui.message.value.trim();
  if (text === '' || current !== undefined) return;
  ui.message.value = '';
  void send(text);
});
ui.message.addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && !event.shiftKey) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});
ui.stop.addEventListener('click', stop);
ui.clear.addEventListener('click', () => {
  if (current !== undefined) stop();
  history.length = 0;
  ui.transcript.replaceChildren();
  ui.frames.replaceChildren();
});
ui.apiKey.value = localStorage.getItem('sluice.apiKey') ?? '';
ui.apiKey.addEventListener('change', () => {
  localStorage.setItem('sluice.apiKey', ui.apiKey.value.trim());
  refreshModels();
});

/**
 * For tests and demos: break the current connection as a network failure would (the page then resumes
 * the stream with Last-Event-ID).
 */
(window as unknown as { sluicePlayground: object }).sluicePlayground = {
  dropConnection(): boolean {
    if (current === undefined || current.stopped) return false;
    current.controller.abort();
    return true;
  },
};

refreshModels();

// A module: its names stay out of the global scope.
export {};
