import type { Context } from 'hono';
import type { AppDeps } from '../app.js';
import { GatewayError } from '../errors.js';
import type { ServedModel } from '../worker-registry.js';

/** A served model as the OpenAI API shows it (`max_model_len` as vLLM adds it). */
function modelObject(model: ServedModel, created: number) {
  return { id: model.id, object: 'model' as const, created, owned_by: 'sluice', max_model_len: model.maxContextLength };
}

/** `GET /v1/models`: the models that live workers serve. */
export function modelsHandler(deps: AppDeps) {
  const created = Math.floor(Date.now() / 1000);
  return (c: Context) => c.json({ object: 'list', data: deps.registry.models().map((model) => modelObject(model, created)) });
}

/** `GET /v1/models/{id}` (the official client's `models.retrieve`); ids may hold `/` (`org/name`). */
export function modelHandler(deps: AppDeps) {
  const created = Math.floor(Date.now() / 1000);
  return (c: Context) => {
    const id = c.req.param('id') ?? '';
    const model = deps.registry.models().find((m) => m.id === id);
    if (model === undefined) {
      throw new GatewayError('model_not_found', {
        message: `The model '${id}' does not exist or no live worker serves it.`,
        param: 'model',
      });
    }
    return c.json(modelObject(model, created));
  };
}
