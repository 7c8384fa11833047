import type { ParsedRequest } from '../openai/request-schemas.js';

/**
 * The most tokens a request can use, reserved against its key's TPM at admission: for each prompt
 * (a completions batch has several), its token count — exact, the gateway tokenizes it (issue 10) —
 * plus n × the completion's ceiling: `max_tokens`, or, when unset, what the context leaves after the
 * prompt (chat) or the endpoint's default (completions). `promptTokenIds` has already refused any
 * request whose prompt + completion cannot fit, so this is a true upper bound; when the request ends
 * its reservation is settled to the real usage.
 */
export function tokenReservation(
  request: Pick<ParsedRequest, 'sampling' | 'defaultMaxTokens' | 'n'>,
  promptLengths: readonly number[],
  maxContextLength: number,
): number {
  let total = 0;
  for (const length of promptLengths) {
    const room = Math.max(0, maxContextLength - length);
    const completion = request.sampling.maxTokens ?? (request.defaultMaxTokens === 'context' ? room : request.defaultMaxTokens);
    total += length + request.n * Math.min(completion, room);
  }
  return total;
}
