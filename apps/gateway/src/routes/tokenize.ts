import type { Context } from 'hono';
import type { AppDeps, AppEnv } from '../app.js';
import { GatewayError } from '../errors.js';
import { parseWith, toJobMessage } from '../openai/request-schemas.js';
import { readJsonBody } from '../read-json-body.js';
import { detokenizeRequestSchema, tokenizeRequestSchema } from '../openai/tokenize-schemas.js';

/** The body, size-limited by MAX_BODY_BYTES as a generation request's is. */
const jsonBody = (deps: AppDeps, c: Context<AppEnv>) => readJsonBody(c.env.incoming, c.env.outgoing, deps.config.maxBodyBytes);

/** The served model, if the caller's API key (when access control is on) may use it. */
function servedModel(deps: AppDeps, c: Context<AppEnv>, model: string) {
  const served = deps.registry.requireModel(model);
  const apiKey = c.get('apiKey');
  if (apiKey !== undefined) deps.access?.admission?.checkModel(apiKey, model);
  return served;
}

/**
 * `POST /tokenize`: the token ids a prompt or a chat becomes, with the model's own tokenizer.
 *
 * A prompt over the model's context (`max_model_len` tokens) is refused, as vLLM refuses it: no
 * request could carry it. Where the tokenizer gives a bound (token-count-bound.ts), one whose byte
 * length alone proves it is too long is refused unencoded, as the completions endpoints refuse it: a
 * prompt of MAX_BODY_BYTES would hold the gateway's thread (every stream on it) for seconds.
 */
export function tokenizeHandler(deps: AppDeps) {
  return async (c: Context<AppEnv>) => {
    const body = parseWith(tokenizeRequestSchema, await jsonBody(deps, c));
    const served = servedModel(deps, c, body.model);
    const tokenizer = await deps.tokenizers.forModel(served);
    const maxModelLen = Math.min(tokenizer.maxContextLength, served.maxContextLength);
    const [encoded, param] =
      body.messages !== undefined
        ? [tokenizer.encodeChat(body.messages.map(toJobMessage), maxModelLen + 1), 'messages']
        : [tokenizer.encodeText(body.prompt ?? '', maxModelLen + 1), 'prompt'];
    const count = Array.isArray(encoded) ? encoded.length : encoded.atLeast;
    if (!Array.isArray(encoded) || count > maxModelLen) {
      throw new GatewayError('context_length_exceeded', {
        message:
          `This model's maximum context length is ${maxModelLen} tokens. ` +
          `However, your prompt is ${Array.isArray(encoded) ? '' : 'at least '}${count} tokens long.`,
        param,
      });
    }
    return c.json({ count, max_model_len: maxModelLen, tokens: encoded });
  };
}

/** `POST /detokenize`: the text of token ids (special tokens dropped, as the completions text is). */
export function detokenizeHandler(deps: AppDeps) {
  return async (c: Context<AppEnv>) => {
    const body = parseWith(detokenizeRequestSchema, await jsonBody(deps, c));
    const tokenizer = await deps.tokenizers.forModel(servedModel(deps, c, body.model));
    const bad = body.tokens.find((id) => id >= tokenizer.vocabSize);
    if (bad !== undefined) {
      throw new GatewayError('invalid_request', {
        message: `tokens: token ids must be in [0, ${tokenizer.vocabSize}), got ${bad}.`,
        param: 'tokens',
      });
    }
    return c.json({ prompt: tokenizer.decode(body.tokens) });
  };
}
