import { z } from 'zod';
import { messageSchema } from './request-schemas.js';

/**
 * `POST /tokenize` and `POST /detokenize` in vLLM's shapes: text or chat messages in (the model's
 * chat template applied, with the assistant turn's opening, as a chat request would be), ids out.
 */
export const tokenizeRequestSchema = z
  .strictObject({
    model: z.string().min(1),
    prompt: z
      .string()
      .optional()
      .meta({ description: "A completion prompt: tokenized with the tokenizer's special tokens, as `/v1/completions` does." }),
    messages: z
      .array(messageSchema)
      .min(1)
      .optional()
      .meta({ description: 'A chat: rendered with the model chat template, as `/v1/chat/completions` does.' }),
  })
  .refine((body) => (body.prompt === undefined) !== (body.messages === undefined), {
    message: 'exactly one of prompt and messages is required.',
    path: ['prompt'],
  })
  .meta({ id: 'TokenizeRequest' });

export const tokenizeResponseSchema = z
  .object({
    count: z.int(),
    max_model_len: z.int(),
    tokens: z.array(z.int()),
  })
  .meta({ id: 'TokenizeResponse' });

export const detokenizeRequestSchema = z
  .strictObject({ model: z.string().min(1), tokens: z.array(z.int().min(0)) })
  .meta({ id: 'DetokenizeRequest' });

export const detokenizeResponseSchema = z.object({ prompt: z.string() }).meta({ id: 'DetokenizeResponse' });
