import type { AccessConfig } from '../auth/access-config.js';
import { GatewayError } from '../errors.js';
import type { ParsedRequest } from './request-schemas.js';

export type InputLimits = Pick<
  AccessConfig,
  'maxTokensLimit' | 'maxStopSequences' | 'maxStopLength' | 'maxMessages' | 'maxN' | 'maxUserLength'
>;

function refuse(param: string, message: string): never {
  throw new GatewayError('invalid_request', { message: `${param}: ${message}`, param });
}

/**
 * The operator's ceilings on a validated request (MAX_TOKENS_LIMIT and friends), checked after the
 * schema so that the schema stays the wire contract and these stay configuration. Each refusal is a
 * 400 naming the field.
 */
export function checkInputLimits(request: ParsedRequest, limits: InputLimits): void {
  const { sampling } = request;
  if (sampling.maxTokens !== undefined && sampling.maxTokens > limits.maxTokensLimit) {
    refuse(request.maxTokensParam, `must be at most ${limits.maxTokensLimit}.`);
  }
  if (request.n > limits.maxN) refuse('n', `must be at most ${limits.maxN}.`);
  const stop = sampling.stop ?? [];
  if (stop.length > limits.maxStopSequences) refuse('stop', `at most ${limits.maxStopSequences} stop sequences.`);
  for (const [i, text] of stop.entries()) {
    if (text.length > limits.maxStopLength) refuse(`stop[${i}]`, `must be at most ${limits.maxStopLength} characters.`);
  }
  if (request.user !== undefined && request.user.length > limits.maxUserLength) {
    refuse('user', `must be at most ${limits.maxUserLength} characters.`);
  }
  if (request.input.kind === 'chat') {
    const { messages } = request.input;
    if (messages.length > limits.maxMessages) refuse('messages', `at most ${limits.maxMessages} messages.`);
    for (const [i, message] of messages.entries()) {
      if (message.name !== undefined && message.name.length > limits.maxUserLength) {
        refuse(`messages[${i}].name`, `must be at most ${limits.maxUserLength} characters.`);
      }
    }
  }
}
