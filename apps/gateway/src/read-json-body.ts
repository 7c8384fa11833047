import type { IncomingMessage, ServerResponse } from 'node:http';
import { GatewayError } from './errors.js';

/**
 * Reads a JSON body straight off the Node request (no web Request/ReadableStream on the hot path),
 * refusing more than `maxBytes`.
 *
 * - Over the limit (declared, or counted as a chunked body arrives): `request_too_large`. The request
 *   is not destroyed (that would take the 413 with it); the reply closes the connection instead, so
 *   the rest of the body is never read.
 * - The client left before the body ended: `client_closed` (a client event, not an internal error).
 * - A `Content-Encoding` other than identity: `unsupported_media_type` (415), the body unread.
 * - One leading UTF-8 byte order mark is skipped (RFC 8259 §8.1 lets a parser ignore it; Windows
 *   tools and .NET clients write one), so the body parses as the same JSON without it.
 */
export function readJsonBody(incoming: IncomingMessage, outgoing: ServerResponse, maxBytes: number): Promise<unknown> {
  const tooLarge = () => {
    outgoing.shouldKeepAlive = false;
    return new GatewayError('request_too_large');
  };
  const encoding = incoming.headers['content-encoding']?.trim().toLowerCase();
  if (encoding !== undefined && encoding !== '' && encoding !== 'identity') {
    // A compressed body is not decoded here (RFC 7694: 415 says so); it is left unread, so the
    // connection closes after the reply.
    outgoing.shouldKeepAlive = false;
    return Promise.reject(
      new GatewayError('unsupported_media_type', {
        message: `Content-Encoding '${encoding}' is not supported: send the body uncompressed.`,
      }),
    );
  }
  const declared = Number(incoming.headers['content-length'] ?? 0);
  if (declared > maxBytes) return Promise.reject(tooLarge());
  if (incoming.destroyed) return Promise.reject(new GatewayError('client_closed'));
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    const stop = () => {
      incoming.off('data', onData);
      incoming.off('end', onEnd);
      incoming.off('error', onGone);
      incoming.off('close', onGone);
    };
    const onData = (chunk: Buffer) => {
      size += chunk.length;
      if (size > maxBytes) {
        stop();
        // Nothing more is read; the body's remaining bytes go unread until the 413 closes the socket.
        incoming.pause();
        reject(tooLarge());
        return;
      }
      chunks.push(chunk);
    };
    const onEnd = () => {
      stop();
      try {
        resolve(JSON.parse(withoutBom(Buffer.concat(chunks, size).toString('utf8'))));
      } catch {
        reject(new GatewayError('invalid_json'));
      }
    };
    const onGone = () => {
      stop();
      reject(new GatewayError('client_closed'));
    };
    incoming.on('data', onData);
    incoming.on('end', onEnd);
    incoming.on('error', onGone);
    incoming.on('close', onGone);
  });
}

/** The text after one leading byte order mark (`toString('utf8')` keeps it, as U+FEFF). */
function withoutBom(text: string): string {
  return text.charCodeAt(0) === 0xfeff ? text.slice(1) : text;
}
