/**
 * `npm run bench:log-memory`: what the per-request token log costs in Redis. Runs real processes
 * (redis-server, one gateway, one worker on the built-in tiny model), streams requests through the
 * gateway, then reads `MEMORY USAGE` of every log and meta key before they expire.
 * Prints bytes per 1,000 tokens logged and writes the figure to docs/benchmarks.md.
 * Env: BENCH_REQUESTS (default 64), BENCH_TOKENS (max_tokens each, default 256).
 */
import { readFile, writeFile } from 'node:fs/promises';
import { cpus } from 'node:os';
import { fileURLToPath } from 'node:url';
import { Cluster, MODEL } from '../../test/support/cluster.js';

const root = fileURLToPath(new URL('../..', import.meta.url));
const requests = Number(process.env.BENCH_REQUESTS ?? 64);
const maxTokens = Number(process.env.BENCH_TOKENS ?? 256);
const log = (message: string) => process.stderr.write(`[bench:log-memory] ${message}\n`);

async function main(): Promise<void> {
  const cluster = await Cluster.start();
  try {
    await cluster.worker({ LOG_LEVEL: 'warn' });
    const gateway = await cluster.gateway({ LOG_LEVEL: 'warn' });
    let tokens = 0;
    await Promise.all(
      Array.from({ length: requests }, async (_, i) => {
        const res = await fetch(`${gateway.url}/v1/completions`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({
            model: MODEL,
            prompt: `Request ${i} about the sea`,
            max_tokens: maxTokens,
            ignore_eos: true,
            temperature: 0,
          }),
        });
        const body = (await res.json()) as { usage: { completion_tokens: number } };
        tokens += body.usage.completion_tokens;
      }),
    );
    const redis = cluster.redis.client();
    const keys = await redis.keys('sluice:{*}:*');
    let logBytes = 0;
    let metaBytes = 0;
    let entries = 0;
    for (const key of keys) {
      const bytes = Number(await redis.call('MEMORY', 'USAGE', key, 'SAMPLES', '0'));
      if (key.endsWith(':log')) {
        logBytes += bytes;
        entries += await redis.xlen(key);
      } else metaBytes += bytes;
    }
    redis.disconnect();
    const perThousand = Math.round(((logBytes + metaBytes) / tokens) * 1000);
    const result = {
      requests,
      tokens,
      entries,
      logBytes,
      metaBytes,
      bytesPer1000Tokens: perThousand,
      logBytesPerEntry: Math.round(logBytes / entries),
    };
    log(JSON.stringify(result));
    const section = [
      '## Token log memory (`npm run bench:log-memory`)',
      '',
      `Measured ${new Date().toISOString().slice(0, 10)} on this machine (${cpus().length} cores, ${cpus()[0]?.model ?? 'cpu'}), tiny model, ` +
        `${requests} completions × ${maxTokens} tokens, one gateway, one worker, redis-server ${'7'}; \`MEMORY USAGE\` of every log and meta key before expiry.`,
      '',
      '| tokens logged | log entries | log bytes | meta bytes | bytes per 1,000 tokens (log + meta) | log bytes per entry |',
      '| ---: | ---: | ---: | ---: | ---: | ---: |',
      `| ${tokens} | ${entries} | ${logBytes} | ${metaBytes} | ${perThousand} | ${result.logBytesPerEntry} |`,
      '',
      'Each text-delta entry holds its JSON (text, token count, token ids): about one entry per token at',
      'batch decode, so the cost is per token, and it is gone `STREAM_RETENTION_MS` after the request ends.',
      '',
    ].join('\n');
    const docs = `${root}docs/benchmarks.md`;
    const text = await readFile(docs, 'utf8');
    const start = text.indexOf('## Token log memory');
    const next = start < 0 ? -1 : text.indexOf('\n## ', start + 1);
    const updated =
      start < 0 ? `${text.trimEnd()}\n\n${section}` : `${text.slice(0, start)}${section}${next < 0 ? '' : text.slice(next + 1)}`;
    await writeFile(docs, updated);
    log(`wrote docs/benchmarks.md`);
  } finally {
    await cluster.stop();
  }
}

await main();
