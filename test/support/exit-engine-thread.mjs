// Ends only the engine thread of a running worker process, from outside, through the Node inspector
// (the process runs with --inspect): `node --experimental-websocket exit-engine-thread.mjs <ws-url>`.
// It attaches to the process's worker threads, prints `ready` once it has the engine thread's session,
// and on a line `exit` on stdin makes that thread run `process.exit(7)` (in a worker thread, that ends
// the thread, not the process); it prints `sent` once the message is written and exits when the
// inspector says the thread is gone, or when the process is.
import { createInterface } from 'node:readline';

const url = process.argv[2];
if (url === undefined) throw new Error('usage: exit-engine-thread.mjs <inspector ws url>');
const socket = new WebSocket(url);
let nextId = 1;
let engineSession;
const send = (method, params) => socket.send(JSON.stringify({ id: nextId++, method, params }));

socket.addEventListener('open', () => send('NodeWorker.enable', { waitForDebuggerOnStart: false }));
socket.addEventListener('message', (event) => {
  const message = JSON.parse(String(event.data));
  if (message.method === 'NodeWorker.attachedToWorker') {
    const { sessionId, workerInfo } = message.params;
    if (engineSession === undefined && /engine-thread/.test(workerInfo.url)) {
      engineSession = sessionId;
      process.stdout.write('ready\n');
    }
  } else if (message.method === 'NodeWorker.detachedFromWorker' && message.params.sessionId === engineSession) {
    process.stdout.write('thread gone\n');
    process.exit(0);
  }
});
socket.addEventListener('close', () => process.exit(0));
socket.addEventListener('error', (event) => {
  process.stderr.write(`inspector socket error: ${String(event.message ?? event)}\n`);
  process.exit(1);
});

createInterface({ input: process.stdin }).on('line', (line) => {
  if (line.trim() !== 'exit' || engineSession === undefined) return;
  const evaluate = { id: 1, method: 'Runtime.evaluate', params: { expression: 'process.exit(7)' } };
  send('NodeWorker.sendMessageToWorker', { sessionId: engineSession, message: JSON.stringify(evaluate) });
  process.stdout.write('sent\n');
});
