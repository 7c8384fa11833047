/**
 * The latency benchmark's HTTP floor, run as its own process: a minimal `node:http` server that
 * answers every POST, once its body is read, with one completion content chunk as an SSE event and
 * `[DONE]`. The same client timing it as the gateway (`throughGateway`) gives the TTFT of the HTTP
 * round trip alone — what the client's `fetch`, loopback and Node's HTTP server take with no gateway,
 * Redis, worker or engine behind them — the part of the gateway path's added TTFT that any HTTP
 * server on this machine would add.
 * Usage: bare-sse-server.ts; prints `port <n>` when listening, exits on SIGTERM.
 */
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';

const CHUNK =
  'data: {"id":"cmpl-bare","object":"text_completion","choices":[{"index":0,"text":" x","logprobs":null,"finish_reason":null}]}\n\n';

const server = createServer((req, res) => {
  req.resume();
  req.once('end', () => {
    res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache' });
    res.end(`${CHUNK}data: [DONE]\n\n`);
  });
});
server.listen(0, '127.0.0.1', () => process.stdout.write(`port ${(server.address() as AddressInfo).port}\n`));
process.once('SIGTERM', () => server.close(() => process.exit(0)));
