/**
 * The load side of the SSE benchmark, in its own process: opens `streams` concurrent streaming
 * requests, counts `data:` events per stream until `[DONE]`, and prints JSON with the delivery rate
 * (events from the first event to the last `[DONE]`).
 * Usage: sse-client.ts <url> <streams>
 */
import { Agent, request } from 'node:http';

const [url, streamsArg] = process.argv.slice(2);
const streams = Number(streamsArg);
const agent = new Agent({ keepAlive: false, maxSockets: Infinity });
const body = JSON.stringify({ model: 'bench', messages: [{ role: 'user', content: 'go' }], stream: true, max_tokens: 1000 });

const MARKER = Buffer.from('data: ');
let firstEventAt = 0;
let lastDoneAt = 0;
let total = 0;

function one(): Promise<number> {
  return new Promise((resolve, reject) => {
    const req = request(`${url}/v1/chat/completions`, { method: 'POST', agent, headers: { 'Content-Type': 'application/json' } }, (res) => {
      let count = 0;
      let tail = Buffer.alloc(0);
      // Raw bytes, no string decoding: the client must cost less per event than the servers it measures.
      res.on('data', (chunk: Buffer) => {
        if (firstEventAt === 0) firstEventAt = performance.now();
        let at = chunk.indexOf(MARKER);
        while (at !== -1) {
          count++;
          at = chunk.indexOf(MARKER, at + MARKER.length);
        }
        // A marker split across two reads: look at the seam only.
        if (tail.length > 0 && Buffer.concat([tail, chunk.subarray(0, MARKER.length - 1)]).includes(MARKER)) count++;
        tail = Buffer.from(chunk.subarray(Math.max(0, chunk.length - (MARKER.length - 1))));
      });
      res.on('end', () => {
        lastDoneAt = performance.now();
        resolve(count);
      });
      res.on('error', reject);
    });
    req.on('error', reject);
    req.end(body);
  });
}

const counts = await Promise.all(Array.from({ length: streams }, one));
total = counts.reduce((a, b) => a + b, 0);
const seconds = (lastDoneAt - firstEventAt) / 1000;
process.stdout.write(`${JSON.stringify({ streams, events: total, seconds, eventsPerSecond: total / seconds })}\n`);
