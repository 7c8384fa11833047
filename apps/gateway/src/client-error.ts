import type { Socket } from 'node:net';
import type { Logger } from 'pino';
import { GatewayError, toErrorBody, type GatewayErrorCode } from './errors.js';
import type { GatewayHooks } from './hooks.js';

/** Node's parser errors (llhttp `HPE_*` codes) → the status and code of our reply. */
function errorFor(code: string | undefined): { status: number; reason: string; error: GatewayErrorCode; message: string } {
  switch (code) {
    case 'HPE_HEADER_OVERFLOW':
      return {
        status: 431,
        reason: 'Request Header Fields Too Large',
        error: 'headers_too_large',
        message: 'The request headers are too large.',
      };
    case 'HPE_REQUEST_TIMEOUT':
    case 'ERR_HTTP_REQUEST_TIMEOUT':
      return { status: 408, reason: 'Request Timeout', error: 'request_timeout', message: 'The request was not received in time.' };
    case 'HPE_CHUNK_EXTENSIONS_OVERFLOW':
      return { status: 413, reason: 'Payload Too Large', error: 'request_too_large', message: 'The request body is too large.' };
    default:
      return { status: 400, reason: 'Bad Request', error: 'bad_http_request', message: 'The request is not valid HTTP/1.1.' };
  }
}

/**
 * The server's `clientError` listener: a request Node's HTTP parser refused (broken framing, headers
 * too large, a timeout) gets the OpenAI error body like every other refusal, instead of Node's bare
 * status line. A reply already under way on that socket is never interleaved with: the socket closes.
 */
export function clientErrorHandler(logger: Logger, hooks: GatewayHooks) {
  return (err: Error & { code?: string }, socket: Socket): void => {
    // The peer is gone (reset, or it closed its side): nothing can be answered.
    if (err.code === 'ECONNRESET' || err.code === 'EPIPE' || !socket.writable) {
      socket.destroy();
      return;
    }
    const inFlight = (socket as Socket & { _httpMessage?: { headersSent?: boolean } })._httpMessage;
    if (inFlight?.headersSent === true) {
      socket.destroy();
      return;
    }
    const { status, reason, error, message } = errorFor(err.code);
    logger.debug({ code: err.code, status }, 'malformed HTTP request refused');
    hooks.rejected?.(error);
    hooks.responded?.('other', status);
    const body = JSON.stringify(toErrorBody(new GatewayError(error, { message })));
    socket.end(
      `HTTP/1.1 ${status} ${reason}\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`,
    );
  };
}
