/**
 * `node --import tsx bench/gateway/profile.ts [gateway|baseline] [streams] [events]`: one round of the
 * SSE write-path benchmark with the server under `node --cpu-prof`, then the top self-time functions
 * of its profile as a markdown table (stdout). The `.cpuprofile` (open it in Chrome DevTools or
 * speedscope for a flame graph) is left in bench-results/profiles/.
 */
import { spawn } from 'node:child_process';
import { mkdir, readdir, readFile, rm } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';

const here = fileURLToPath(new URL('.', import.meta.url));
const root = fileURLToPath(new URL('../..', import.meta.url));
const [mode = 'gateway', streams = '1000', events = '150', stepMs = '40', warmup = '0'] = process.argv.slice(2);
const dir = `${root}bench-results/profiles/${mode}-sse`;

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
  hitCount?: number;
}

await rm(dir, { recursive: true, force: true });
await mkdir(dir, { recursive: true });
const server = spawn(
  process.execPath,
  ['--cpu-prof', `--cpu-prof-dir=${dir}`, '--import', 'tsx', `${here}sse-server.ts`, mode, streams, events, stepMs, warmup],
  {
    stdio: ['ignore', 'pipe', 'inherit'],
  },
);
const port = await new Promise<number>((resolve) => {
  server.stdout.setEncoding('utf8').on('data', (text: string) => {
    const match = /^port (\d+)$/m.exec(text);
    if (match) resolve(Number(match[1]));
  });
});
const client = spawn(process.execPath, ['--import', 'tsx', `${here}sse-client.ts`, `http://127.0.0.1:${port}`, streams], {
  stdio: ['ignore', 'pipe', 'inherit'],
});
let out = '';
client.stdout.setEncoding('utf8').on('data', (text: string) => (out += text));
await new Promise((resolve) => client.once('exit', resolve));
server.kill('SIGTERM');
await new Promise((resolve) => server.once('exit', resolve));

// tsx's loader hooks run on a thread of their own, which writes its own profile: take the main thread's (the largest).
let file = '';
let largest = -1;
for (const name of await readdir(dir)) {
  const size = (await readFile(`${dir}/${name}`)).length;
  if (size > largest) [file, largest] = [name, size];
}
const profile = JSON.parse(await readFile(`${dir}/${file}`, 'utf8')) as { nodes: ProfileNode[]; samples: number[] };
const self = new Map<string, number>();
let total = 0;
for (const node of profile.nodes) {
  const hits = node.hitCount ?? 0;
  if (hits === 0) continue;
  const { functionName, url, lineNumber } = node.callFrame;
  const where =
    url === ''
      ? ''
      : `${url
          .replace(/^file:\/\//, '')
          .replace(root, '')
          .replace(/^.*node_modules\//, '')}:${lineNumber + 1}`;
  const key = `${functionName || '(anonymous)'} ${where}`.trim();
  self.set(key, (self.get(key) ?? 0) + hits);
  total += hits;
}
const idle = [...self].filter(([k]) => k.startsWith('(idle)') || k.startsWith('(program)')).reduce((s, [, v]) => s + v, 0);
const busy = total - idle;
process.stdout.write(`round: ${out.trim()}\n\n| self % of busy samples | function |\n|---:|---|\n`);
for (const [key, hits] of [...self]
  .filter(([k]) => !k.startsWith('(idle)') && !k.startsWith('(program)'))
  .sort((a, b) => b[1] - a[1])
  .slice(0, 25)) {
  process.stdout.write(`| ${((100 * hits) / busy).toFixed(1)} | \`${key}\` |\n`);
}
process.stdout.write(
  `\n${busy} busy samples of ${total} (idle and (program) excluded); profile: bench-results/profiles/${mode}-sse/${file}\n`,
);
