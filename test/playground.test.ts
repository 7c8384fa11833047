import { existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium, type Browser, type Page } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { startNginx, type NginxServer } from './support/nginx.js';
import { waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import { freezeMidAnswers, retryMidAnswer } from './support/mid-answer.js';
import { collectSse } from './support/sse.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';

/**
 * The playground page in a real headless Chromium (Debian's `chromium`, driven by playwright-core)
 * against a real gateway, Redis and worker: a message streams in, Stop cancels the worker's sequence,
 * and a dropped connection is resumed with Last-Event-ID without losing or repeating a token.
 */

const CHROMIUM = process.env.CHROMIUM_PATH ?? '/usr/bin/chromium';
/** Tokens of the resumed streams: about 2 s of decoding on an idle machine, far more than a poll. */
const RESUME_TOKENS = 1536;
const CHROMIUM_ARGS = [
  '--headless',
  '--no-sandbox',
  '--disable-gpu',
  '--disable-background-networking',
  '--disable-component-update',
  '--no-first-run',
];
const README_SCREENSHOT = fileURLToPath(new URL('../docs/playground.png', import.meta.url));
/**
 * The README's screenshot is taken by this test: written into docs/ when missing or when
 * SLUICE_UPDATE_SCREENSHOT=1, else next to the test's temp files (a test run leaves the tree clean).
 */
const SCREENSHOT =
  process.env.SLUICE_UPDATE_SCREENSHOT === '1' || !existsSync(README_SCREENSHOT)
    ? README_SCREENSHOT
    : join(tmpdir(), 'sluice-playground.png');

/**
 * The whole answer of a stream as the gateways logged it: the resume route from before the first event
 * (`starting_after=-1`), for comparing with what the page shows without generating it again.
 */
async function loggedText(baseUrl: string, chunkId: string): Promise<string> {
  const res = await fetch(`${baseUrl}/v1/chat/completions/${chunkId}?stream=true&starting_after=-1`);
  const items = await collectSse(res.body!);
  return items
    .filter((item): item is Extract<typeof item, { kind: 'data' }> => item.kind === 'data' && item.data !== '[DONE]')
    .map((item) => (JSON.parse(item.data) as { choices: Array<{ delta?: { content?: string } }> }).choices[0]?.delta?.content ?? '')
    .join('');
}

/**
 * Sends a message with `send` and, once the page shows two tokens, freezes `worker` (SIGSTOP) with the
 * page's answer unfinished in its token log (see mid-answer.ts), whatever the machine's speed; an
 * answer that ended first is let finish and the message sent again (5 tries). The caller thaws it.
 */
async function freezeWithAnswerUnderWay(
  page: Page,
  worker: WorkerProcess,
  cluster: Cluster,
  send: () => Promise<void>,
  maxTokens: number,
): Promise<void> {
  const redis = cluster.redis.client();
  try {
    await retryMidAnswer("the page's answer", async () => {
      await send();
      await page.waitForFunction("Number(document.querySelector('#tokens').textContent) >= 2", undefined, { timeout: 30_000 });
      const jobId = ((await page.textContent('#request-id')) ?? '').replace(/^chatcmpl-/, '');
      if ((await freezeMidAnswers([worker], redis, [{ jobId }], maxTokens)) !== null) return true;
      await page.waitForFunction("document.querySelector('#status').textContent === 'Done.'", undefined, { timeout: 100_000 });
      return undefined;
    });
  } finally {
    redis.disconnect();
  }
}

describe.skipIf(!existsSync(CHROMIUM))('the playground in headless Chromium', () => {
  let cluster: Cluster;
  let gateway: GatewayProcess;
  let worker: WorkerProcess;
  let browser: Browser;
  let page: Page;
  const consoleErrors: string[] = [];
  let contextLength = 0;

  beforeAll(async () => {
    cluster = await Cluster.start();
    worker = await cluster.worker();
    gateway = await cluster.gateway();
    const models = (await gateway.get('/v1/models')).body as { data: Array<{ max_model_len: number }> };
    contextLength = models.data[0]!.max_model_len;
    browser = await chromium.launch({
      executablePath: CHROMIUM,
      args: CHROMIUM_ARGS,
    });
    page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
    page.on('console', (message) => {
      if (message.type() === 'error') consoleErrors.push(message.text());
    });
    await page.goto(`${gateway.url}/`);
    await page.waitForSelector(`#model option[value="${MODEL}"]`, { state: 'attached' });
  }, 180_000);

  afterAll(async () => {
    await browser?.close();
    await cluster?.stop();
  });

  async function setParams(params: { max_tokens: number; temperature?: number; ignoreEos?: boolean; seed?: number }): Promise<void> {
    await page.fill('#max_tokens', String(params.max_tokens));
    await page.fill('#temperature', String(params.temperature ?? 0));
    await page.fill('#seed', params.seed === undefined ? '' : String(params.seed));
    await page.setChecked('#ignore_eos', params.ignoreEos ?? false);
  }

  async function sendMessage(text: string): Promise<void> {
    await page.click('#clear');
    await page.fill('#message', text);
    await page.press('#message', 'Enter');
  }

  const lastAnswer = () => page.locator('.turn.assistant .text').last().textContent();

  /** What the API answers to the same single-turn chat (greedy, so the same text). */
  async function apiAnswer(text: string, maxTokens: number, extra: Record<string, unknown> = {}): Promise<string> {
    const res = await fetch(`${gateway.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: text }], max_tokens: maxTokens, temperature: 0, ...extra }),
    });
    return ((await res.json()) as { choices: Array<{ message: { content: string } }> }).choices[0]!.message.content;
  }

  it('streams a message: tokens arrive, then time to first token, tokens, tokens/s and the finish', async () => {
    await setParams({ max_tokens: 24 });
    await sendMessage('Tell me about the sea.');
    await page.waitForFunction("document.querySelector('#finish').textContent !== '–'", undefined, { timeout: 30_000 });
    await page.waitForFunction("document.querySelector('#status').textContent === 'Done.'");
    expect(await lastAnswer()).toBe(await apiAnswer('Tell me about the sea.', 24));
    expect(await page.textContent('#ttft')).toMatch(/^\d+ ms$/);
    expect(Number(await page.textContent('#tokens'))).toBeGreaterThan(0);
    expect(await page.textContent('#tps')).toMatch(/^\d+(\.\d)?$/);
    expect(await page.textContent('#request-id')).toMatch(/^chatcmpl-/);
    // Raw frames on demand: the SSE events as they came, id lines included.
    await page.click('#raw summary');
    const frames = (await page.textContent('#frames')) ?? '';
    expect(frames).toContain('data: [DONE]');
    expect(frames).toMatch(/^id: \d+$/m);
    await page.screenshot({ path: SCREENSHOT });
    await page.click('#raw summary');
    // (A request for /favicon.ico was a 404 in the console.)
    expect(consoleErrors).toEqual([]);
  });

  it('serves the API reference at /docs from local files only: every operation of /openapi.json is shown', async () => {
    const docs = await browser.newPage();
    const origins = new Set<string>();
    docs.on('request', (request) => origins.add(new URL(request.url()).origin));
    // The trailing-slash form leads there too.
    await docs.goto(`${gateway.url}/docs/`);
    expect(new URL(docs.url()).pathname).toBe('/docs');
    const spec = (await (await fetch(`${gateway.url}/openapi.json`)).json()) as { paths: Record<string, object> };
    const operations = Object.values(spec.paths).reduce((sum, item) => sum + Object.keys(item).length, 0);
    await docs.waitForFunction(`document.querySelectorAll('.opblock').length === ${operations}`, undefined, { timeout: 30_000 });
    expect([...origins].filter((origin) => origin !== 'null' && !origin.startsWith('data:'))).toEqual([gateway.url]);
    await docs.close();
  });

  it('stops a running stream, and the worker cancels its sequence', async () => {
    const before = (await scrapePrometheus(worker.healthUrl.replace('/healthz', '/metrics'))).value('sluice_request_success_total', {
      finish_reason: 'abort',
    });
    // As long as the context allows, past the end-of-sequence token, and frozen mid-answer: the worker
    // cannot finish before Stop is pressed (no race with the machine's speed).
    await setParams({ max_tokens: contextLength - 64, ignoreEos: true });
    await freezeWithAnswerUnderWay(page, worker, cluster, () => sendMessage('Count slowly.'), contextLength - 64);
    try {
      await page.click('#stop');
      await page.waitForFunction("document.querySelector('#status').textContent === 'Stopped.'");
    } finally {
      worker.process.signal('SIGCONT');
    }
    const requestId = ((await page.textContent('#request-id')) ?? '').replace(/^chatcmpl-/, '');
    await worker.sequenceCancelled(requestId);
    await waitFor('the abort counted in the worker metrics', async () => {
      const after = (await scrapePrometheus(worker.healthUrl.replace('/healthz', '/metrics'))).value('sluice_request_success_total', {
        finish_reason: 'abort',
      });
      return after === before + 1 ? true : undefined;
    });
    expect(await page.isDisabled('#stop')).toBe(true);
  });

  it('resumes a dropped stream with Last-Event-ID: the answer arrives whole, each token once', async () => {
    const maxTokens = RESUME_TOKENS;
    await setParams({ max_tokens: maxTokens, ignoreEos: true });
    // Frozen mid-answer, the stream breaks off (the page's fetch fails as on a network error) while the
    // request runs on.
    await freezeWithAnswerUnderWay(page, worker, cluster, () => sendMessage('Tell me a story.'), maxTokens);
    try {
      expect(await page.evaluate('window.sluicePlayground.dropConnection()')).toBe(true);
    } finally {
      worker.process.signal('SIGCONT');
    }
    await page.waitForFunction("document.querySelector('#status').textContent === 'Done.'", undefined, { timeout: 100_000 });
    expect(await page.textContent('#resumes')).toBe('1');
    expect(await page.textContent('#finish')).toBe('length');
    expect(Number(await page.textContent('#tokens'))).toBe(maxTokens);
    const chunkId = (await page.textContent('#request-id')) ?? '';
    expect(await lastAnswer()).toBe(await loggedText(gateway.url, chunkId));
  });
});

describe.skipIf(!existsSync(CHROMIUM))('the playground behind nginx when the gateway holding its stream dies', () => {
  let cluster: Cluster;
  let worker: WorkerProcess;
  let gateways: GatewayProcess[];
  let nginx: NginxServer;
  let browser: Browser;

  beforeAll(async () => {
    cluster = await Cluster.start();
    worker = await cluster.worker();
    gateways = await Promise.all([cluster.gateway(), cluster.gateway()]);
    nginx = await startNginx({ upstreamPorts: gateways.map((g) => Number(new URL(g.url).port)) });
    browser = await chromium.launch({ executablePath: CHROMIUM, args: CHROMIUM_ARGS });
  }, 180_000);

  afterAll(async () => {
    await browser?.close();
    await nginx?.close();
    await cluster?.stop();
  });

  it('resumes on the other gateway with Last-Event-ID after a real connection loss: the whole answer, each token once', async () => {
    const page = await browser.newPage();
    await page.goto(`${nginx.url}/`);
    await page.waitForSelector(`#model option[value="${MODEL}"]`, { state: 'attached' });
    const maxTokens = RESUME_TOKENS;
    await page.fill('#max_tokens', String(maxTokens));
    await page.fill('#temperature', '0');
    await page.setChecked('#ignore_eos', true);
    // Frozen generation, with the page's answer unfinished, so the kill lands mid-stream; then the
    // gateway that holds the page's stream dies: nginx cuts the page's connection, the fetch fails as
    // on any network loss.
    await freezeWithAnswerUnderWay(
      page,
      worker,
      cluster,
      async () => {
        await page.click('#clear');
        await page.fill('#message', 'Tell me a long story.');
        await page.press('#message', 'Enter');
      },
      maxTokens,
    );
    try {
      const active = await Promise.all(
        gateways.map(async (g) => (await scrapePrometheus(`${g.url}/metrics`)).value('sluice_gateway_active_streams')),
      );
      const victim = gateways[active.indexOf(1)];
      if (victim === undefined) throw new Error(`no gateway holds the page's stream (active streams: ${active.join(', ')})`);
      victim.process.child.kill('SIGKILL');
      await victim.process.exited;
    } finally {
      worker.process.signal('SIGCONT');
    }
    await page.waitForFunction("document.querySelector('#status').textContent === 'Done.'", undefined, { timeout: 100_000 });
    expect(Number(await page.textContent('#resumes'))).toBeGreaterThanOrEqual(1);
    expect(await page.textContent('#finish')).toBe('length');
    const survivor = gateways.find((g) => g.process.child.exitCode === null && g.process.child.signalCode === null)!;
    const chunkId = (await page.textContent('#request-id')) ?? '';
    expect(await page.locator('.turn.assistant .text').last().textContent()).toBe(await loggedText(survivor.url, chunkId));
    expect(Number(await page.textContent('#tokens'))).toBe(maxTokens);
  });
});
