import type { CheckedPrompt } from '../prompt-tokens.js';

/**
 * The most tokens a request can use, reserved against its key's TPM at admission: for each prompt
 * (a completions batch has several), its token count — exact, the gateway tokenizes it (issue 10) —
 * plus n × its completion limit as the gateway resolved it (`max_tokens`, or its default: the context
 * left within the workers' KV cache for a chat, the endpoint's default for completions), which its job
 * carries to the worker. A true upper bound; when the request ends it is settled to the real usage.
 */
export function tokenReservation(n: number, prompts: ReadonlyArray<Pick<CheckedPrompt, 'ids' | 'maxTokens'>>): number {
  let total = 0;
  for (const { ids, maxTokens } of prompts) total += ids.length + n * maxTokens;
  return total;
}
