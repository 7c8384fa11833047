import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Cluster, MODEL } from './support/cluster.js';
import { waitFor } from './support/processes.js';
import { scrapePrometheus } from './support/prometheus.js';
import type { GatewayProcess, WorkerProcess } from './support/sluice.js';
import { checkChunkSequence, LiveStream } from './support/sse.js';

/**
 * Flow control end to end (issue 10): real gateway, worker (tiny model) and redis-server; clients on
 * real sockets whose receive window is tiny (Python: Node cannot set SO_RCVBUF), so a client that does
 * not read backs the gateway's writes up at once instead of vanishing into loopback buffers.
 */

const SOCKETS = fileURLToPath(new URL('./support/slow-sockets.py', import.meta.url));
const STALL_MS = 1_000;

const completion = (prompt: string, maxTokens: number) => ({
  model: MODEL,
  prompt,
  max_tokens: maxTokens,
  ignore_eos: true,
  temperature: 0,
  stream: true,
});

/** Text and gaps between content chunks (ms) of a stream read at full speed. */
async function readNormally(url: string, body: object): Promise<{ text: string; gaps: number[] }> {
  const stream = new LiveStream(url, body);
  expect(await stream.ended).toBe('done');
  const times = stream.items.flatMap((item) => (item.kind === 'data' && item.data.includes('"text":"') ? [item.at] : []));
  return {
    text: checkChunkSequence(stream.items, 'completion', false).text,
    gaps: times.slice(1).map((at, i) => at - times[i]!),
  };
}

function p99(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(0.99 * sorted.length))] ?? NaN;
}

/** The body of a raw HTTP/1.1 chunked reply. */
function dechunk(raw: Buffer): string {
  let at = raw.indexOf('\r\n\r\n') + 4;
  let body = '';
  for (;;) {
    const end = raw.indexOf('\r\n', at);
    const size = parseInt(raw.subarray(at, end).toString('latin1'), 16);
    if (!(size > 0)) return body;
    body += raw.subarray(end + 2, end + 2 + size).toString('utf8');
    at = end + 2 + size + 2;
  }
}

function rssKb(pid: number): Promise<number> {
  return readFile(`/proc/${pid}/status`, 'utf8').then((status) => Number(/VmRSS:\s+(\d+)/.exec(status)?.[1]));
}

describe('clients that read slowly or not at all', () => {
  let cluster: Cluster;
  let worker: WorkerProcess;
  let gateway: GatewayProcess;
  let dir: string;
  let port: number;

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'sluice-slow-'));
    cluster = await Cluster.start();
    worker = await cluster.worker({ MAX_BATCH_SIZE: '32' });
    gateway = await cluster.gateway({ CLIENT_STALL_TIMEOUT_MS: String(STALL_MS) });
    port = Number(new URL(gateway.url).port);
  }, 120_000);

  afterAll(async () => {
    await cluster?.stop();
    await rm(dir, { recursive: true, force: true });
  });

  it('ends 20 streams whose clients never read and stops their work, while 8 normal streams go on unchanged', async () => {
    const normal = Array.from({ length: 8 }, (_, i) => completion(`Normal client ${i} tells a story`, 300));
    const url = `${gateway.url}/v1/completions`;
    // The normal streams alone first: their texts, and their inter-chunk gaps for comparison.
    const alone = await Promise.all(normal.map((body) => readNormally(url, body)));

    const bodyFile = join(dir, 'stuck.json');
    // As long as the tiny model's context allows: many times the stall timeout's worth of tokens.
    await writeFile(bodyFile, JSON.stringify(completion('Nobody reads this story', 2000)));
    const rssBefore = await rssKb(gateway.process.pid);
    const stuck: ChildProcessWithoutNullStreams = spawn('python3', [SOCKETS, 'stuck', '127.0.0.1', String(port), '20', bodyFile]);
    try {
      await new Promise<void>((resolve, reject) => {
        stuck.stdout.on('data', (text: Buffer) => (text.toString().includes('sent 20') ? resolve() : undefined));
        stuck.once('exit', (code) => reject(new Error(`slow-sockets.py exited ${code}`)));
      });
      const beside = await Promise.all(normal.map((body) => readNormally(url, body)));
      // Every stuck stream ends (stall timeout) and its work stops.
      const ended = await waitFor(
        'the 20 stuck streams ended as slow clients',
        async () => {
          const metrics = await scrapePrometheus(`${gateway.url}/metrics`);
          return metrics.value('sluice_gateway_request_outcomes_total', { outcome: 'slow_client' }) === 20 ? metrics : undefined;
        },
        30_000,
      );
      const rssDuring = await rssKb(gateway.process.pid);
      expect(ended.value('sluice_gateway_slow_clients_total', { cause: 'stall' })).toBe(20);
      await waitFor('the worker idle', async () => ((await worker.health()).running === 0 ? true : undefined));
      const work = await scrapePrometheus(`${worker.healthUrl.replace(/\/healthz$/, '')}/metrics`);
      // The worker aborted the stuck streams still running when the gateway gave up on them: they left
      // the engine as `abort`, short of their 2,000 tokens each. How far they got depends on the
      // machine's speed (11,500–22,100 of 40,000 in all on the hosts so far), so a fast enough machine
      // may finish some before the stall timeout fires (the normal streams, alone then beside, account
      // for 16 of the `length` endings): those are counted, and at least one must have been stopped.
      const aborted = work.value('sluice_request_success_total', { finish_reason: 'abort' });
      const stuckFinished = work.value('sluice_request_success_total', { finish_reason: 'length' }) - 2 * normal.length;
      expect(aborted + stuckFinished).toBe(20);
      expect(aborted).toBeGreaterThan(0);
      const generated = work.histogram('sluice_request_generation_tokens', { finish_reason: 'abort' }).sum;
      expect(generated).toBeLessThan(aborted * 2000);
      // The normal streams: the same text as alone.
      beside.forEach((run, i) => expect(run.text, `normal stream ${i}`).toBe(alone[i]!.text));
      const [aloneP99, besideP99] = [p99(alone.flatMap((r) => r.gaps)), p99(beside.flatMap((r) => r.gaps))];
      console.log(
        `slow clients: ${aborted} of 20 stuck streams stopped (${stuckFinished} had finished) after ${generated} of ${aborted * 2000} tokens ` +
          `(stall timeout ${STALL_MS} ms); gateway RSS ${Math.round(rssBefore / 1024)} MiB before, ${Math.round(rssDuring / 1024)} MiB ` +
          `with them; 8 normal streams' inter-chunk p99 ${aloneP99} ms alone, ${besideP99} ms beside them`,
      );
      // Bounded by the setting, not by max_tokens: 20 × MAX_STREAM_BUFFER_BYTES (1 MiB) plus the heap's
      // own growth with 28 streams (9–13 MiB in all measured here).
      expect(rssDuring - rssBefore).toBeLessThan(36 * 1024);
    } finally {
      stuck.stdin.end();
      stuck.kill();
    }
  }, 120_000);

  it('gives a client that reads ~5 tokens a second fewer, larger chunks and the whole text', async () => {
    // The default stall timeout (30 s): a slow reader is not a stuck one. (Its socket drains Node's
    // 16 KB buffer in ~20 s at this pace; the other test's 1 s timeout would end it.)
    const patient = await cluster.gateway();
    const patientPort = Number(new URL(patient.url).port);
    const body = completion('A slow reader gets every word', 800);
    const { text } = await readNormally(`${patient.url}/v1/completions`, body);
    const bodyFile = join(dir, 'slow.json');
    const outFile = join(dir, 'slow.out');
    await writeFile(bodyFile, JSON.stringify(body));
    // 160 bytes (about one single-token chunk) five times a second: a client taking ~5 tokens/s while
    // the tiny model writes hundreds. What the kernel and Node buffered before the socket congested
    // (~60 KB with this MSS) still arrives a token per chunk; everything after, coalesced.
    const reader = spawn('python3', [SOCKETS, 'slow', '127.0.0.1', String(patientPort), bodyFile, outFile, '160', '200']);
    const code = await new Promise<number | null>((resolve) => reader.once('exit', resolve));
    expect(code).toBe(0);
    const sse = dechunk(await readFile(outFile));
    const chunks = [...sse.matchAll(/^data: (\{.*\})$/gm)].map((m) => JSON.parse(m[1]!) as { choices: Array<{ text: string }> });
    const texts = chunks.map((chunk) => chunk.choices[0]?.text ?? '').filter((t) => t !== '');
    expect(texts.join('')).toBe(text);
    expect(sse).toContain('data: [DONE]');
    // Coalesced while the socket did not drain: fewer chunks than tokens, some carrying many.
    expect(texts.length).toBeLessThan(800);
    expect(Math.max(...texts.map((t) => t.length))).toBeGreaterThan(20);
    console.log(
      `slow reader (5 reads of 160 bytes a second): 800 tokens in ${texts.length} content chunks (longest ${Math.max(...texts.map((t) => t.length))} characters)`,
    );
  }, 240_000);
});
