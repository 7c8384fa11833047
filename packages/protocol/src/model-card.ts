import { createHash } from 'node:crypto';
import { z } from 'zod';

/**
 * What a gateway needs to prepare prompts for a model without loading it: the tokenizer files, the
 * chat template and the generation facts a request is checked against. A worker writes its card to
 * Redis at registration, under the hash of its content (`modelCardKey`), and names the hash in its
 * registry record; gateways load each hash once and cache it. Real tokenizers run to megabytes, so
 * the card travels only when a gateway sees a hash for the first time.
 */
export const modelCardSchema = z.object({
  /** `tokenizer.json`, verbatim. */
  tokenizerJson: z.string().min(2),
  /** `tokenizer_config.json`, verbatim (`{}` when the model has none). */
  tokenizerConfigJson: z.string().min(2),
  /** The chat template source in use (`chat_template.jinja` wins over the config's); null: completions only. */
  chatTemplate: z.string().nullable(),
  /** Max prompt + completion tokens. */
  maxContextLength: z.number().int().positive(),
});
export type ModelCard = z.infer<typeof modelCardSchema>;

export function encodeModelCard(card: ModelCard): string {
  return JSON.stringify(card);
}

/** The content hash that names a card in Redis and in worker records. */
export function modelCardHash(encoded: string): string {
  return createHash('sha256').update(encoded).digest('hex');
}

/** Returns undefined for a malformed card (a foreign writer): the gateway treats the model as unknown. */
export function decodeModelCard(raw: string | Buffer): ModelCard | undefined {
  try {
    const result = modelCardSchema.safeParse(JSON.parse(typeof raw === 'string' ? raw : raw.toString('utf8')));
    return result.success ? result.data : undefined;
  } catch {
    return undefined;
  }
}
