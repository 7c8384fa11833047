/**
 * `node --import tsx bench/gateway/decode-forms.ts`: what a gateway pays to decode one step message of
 * 1,000 text deltas in the token log's form (token ids included) and in the live form the channel
 * carries (`encodeEntry`), ms of CPU per message, medians of 10 alternating rounds of 200 messages.
 */
import { randomUUID } from 'node:crypto';
import { decodeGatewayMessage, encodeEntry, liveGatewayMessage } from '@sluice/protocol';
import { median, round } from './stats.js';

const entries = 1000;
const messages = 200;
const ids = Array.from({ length: entries }, () => `chatcmpl-${randomUUID()}`);
const forms = ['logged', 'live'] as const;
const built = Object.fromEntries(
  forms.map((form) => [
    form,
    Array.from({ length: messages }, (_, step) =>
      Buffer.from(
        liveGatewayMessage(
          'w1',
          ids.map(
            (requestId) =>
              encodeEntry({ type: 'text-delta', index: 0, text: ' token', tokens: 1, tokenIds: [1000 + step], requestId, seq: step })[form],
          ),
        ),
      ),
    ),
  ]),
) as Record<(typeof forms)[number], Buffer[]>;
const msPerMessage: Record<(typeof forms)[number], number[]> = { logged: [], live: [] };
for (let r = 0; r < 10; r++) {
  for (const form of r % 2 === 0 ? forms : [...forms].reverse()) {
    const start = process.cpuUsage();
    for (const raw of built[form]) decodeGatewayMessage(raw);
    const used = process.cpuUsage(start);
    msPerMessage[form].push((used.user + used.system) / 1000 / messages);
  }
}
for (const form of forms) {
  console.log(`${form}: ${built[form][0]!.length} bytes per message, ${round(median(msPerMessage[form]), 3)} ms of CPU to decode one`);
}
