import type { Context } from 'hono';
import type { AppDeps } from '../app.js';

/** `GET /v1/models`: the models that live workers serve. */
export function modelsHandler(deps: AppDeps) {
  const created = Math.floor(Date.now() / 1000);
  return (c: Context) =>
    c.json({
      object: 'list',
      data: deps.registry.models().map((model) => ({
        id: model.id,
        object: 'model',
        created,
        owned_by: 'sluice',
        max_model_len: model.maxContextLength,
      })),
    });
}
