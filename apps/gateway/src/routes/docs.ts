import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import type { Context } from 'hono';
import { createOpenApiDocument } from '../openapi/openapi-document.js';
import { gatewayVersion } from '../version.js';

/** `GET /openapi.json`: built on the first request, then served as is. */
export function openApiHandler() {
  let body: string | undefined;
  return (c: Context) => {
    body ??= JSON.stringify(createOpenApiDocument(gatewayVersion()));
    return c.body(body, 200, { 'Content-Type': 'application/json; charset=utf-8', 'Cache-Control': 'no-cache' });
  };
}

/** Swagger UI's files that `/docs` uses, served from the installed `swagger-ui-dist` (no CDN). */
const ASSETS: Record<string, string> = {
  'swagger-ui.css': 'text/css; charset=utf-8',
  'swagger-ui-bundle.js': 'text/javascript; charset=utf-8',
};

const PAGE = `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sluice API reference</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="/docs/swagger-ui.css">
</head>
<body>
<div id="reference"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>
  window.ui = SwaggerUIBundle({ url: '/openapi.json', dom_id: '#reference', deepLinking: true, tryItOutEnabled: true });
</script>
</body>
</html>
`;

/** `GET /docs`: the interactive reference (Swagger UI over `/openapi.json`), and its files. */
export function docsHandlers() {
  const files = new Map<string, Promise<Buffer>>();
  const dir = () => dirname(createRequire(import.meta.url).resolve('swagger-ui-dist/package.json'));
  return {
    page: (c: Context) => c.html(PAGE),
    asset: async (c: Context) => {
      const name = c.req.param('file') ?? '';
      const type = ASSETS[name];
      if (type === undefined) return c.notFound();
      let file = files.get(name);
      if (file === undefined) {
        file = readFile(join(dir(), name));
        files.set(name, file);
      }
      return c.body(new Uint8Array(await file), 200, { 'Content-Type': type, 'Cache-Control': 'public, max-age=3600' });
    },
  };
}
