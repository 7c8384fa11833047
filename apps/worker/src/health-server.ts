import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';

export type RouteHandler = (req: IncomingMessage, res: ServerResponse) => void | Promise<void>;

/**
 * The worker's small HTTP endpoint on METRICS_PORT: `GET /healthz` with the running counts, plus any
 * routes added by the caller (`/metrics` lands here).
 */
export class HealthServer {
  private readonly server: Server;
  private readonly routes = new Map<string, RouteHandler>();

  constructor(health: () => object) {
    this.routes.set('/healthz', (_req, res) => {
      const body = JSON.stringify(health());
      res.writeHead(200, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(body) });
      res.end(body);
    });
    this.server = createServer((req, res) => {
      const handler = req.method === 'GET' ? this.routes.get((req.url ?? '/').split('?')[0] ?? '/') : undefined;
      if (handler === undefined) {
        res.writeHead(404).end();
        return;
      }
      Promise.resolve(handler(req, res)).catch(() => {
        if (!res.headersSent) res.writeHead(500);
        res.end();
      });
    });
  }

  /** Adds a GET route (e.g. `/metrics`). */
  route(path: string, handler: RouteHandler): void {
    this.routes.set(path, handler);
  }

  async listen(port: number, host: string): Promise<number> {
    await new Promise<void>((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, host, () => resolve());
    });
    return (this.server.address() as AddressInfo).port;
  }

  async close(): Promise<void> {
    await new Promise<void>((resolve) => {
      this.server.close(() => resolve());
      this.server.closeAllConnections();
    });
  }
}
