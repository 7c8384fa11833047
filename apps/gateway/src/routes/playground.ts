import { readFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import type { Context } from 'hono';
import { GatewayError } from '../errors.js';

/**
 * The playground's built files (`playground/` compiled and copied by the gateway's build): the same
 * directory whether this module runs from `dist/routes` or, in tests, from `src/routes`.
 */
const DIR = fileURLToPath(new URL('../../dist/playground/', import.meta.url));

const FILES: Record<string, string> = {
  'index.html': 'text/html; charset=utf-8',
  'playground.js': 'text/javascript; charset=utf-8',
  'playground.css': 'text/css; charset=utf-8',
};

/** `GET /` (the page) and `GET /playground/{file}` (its script and style), read once and kept. */
export function playgroundHandlers() {
  const cache = new Map<string, Promise<Buffer>>();
  const serve = async (c: Context, name: string) => {
    const type = FILES[name];
    if (type === undefined) return c.notFound();
    let file = cache.get(name);
    if (file === undefined) {
      file = readFile(`${DIR}${name}`);
      cache.set(name, file);
      // A failed read is not kept: the build may produce the file later (development).
      file.catch(() => cache.delete(name));
    }
    let body: Buffer;
    try {
      body = await file;
    } catch (cause) {
      throw new GatewayError('not_found', { message: 'The playground is not built (run the build).', cause });
    }
    return c.body(new Uint8Array(body), 200, { 'Content-Type': type, 'Cache-Control': 'no-cache' });
  };
  return {
    page: (c: Context) => serve(c, 'index.html'),
    file: (c: Context) => serve(c, c.req.param('file') ?? ''),
  };
}
