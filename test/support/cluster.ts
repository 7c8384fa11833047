/** Redis + workers + gateways for one test file, torn down together. */
import { startRedis, type RedisServer } from './redis-server.js';
import { startGateway, startWorker, type GatewayProcess, type WorkerProcess } from './sluice.js';

/** `SLUICE_E2E_FAKE_ENGINE=1` runs the workers on the fake engine (developing the stream path without a model). */
export const FAKE_ENGINE = process.env.SLUICE_E2E_FAKE_ENGINE === '1';
/** The model id the test workers serve. */
export const MODEL = FAKE_ENGINE ? 'fake' : 'tiny';

export class Cluster {
  readonly gateways: GatewayProcess[] = [];
  readonly workers: WorkerProcess[] = [];

  private constructor(readonly redis: RedisServer) {}

  /** @param redis how its Redis runs (persistence: see startRedis) */
  static async start(redis: { appendOnlyDir?: string } = {}): Promise<Cluster> {
    return new Cluster(await startRedis(redis));
  }

  async worker(env: Record<string, string> = {}): Promise<WorkerProcess> {
    const worker = await startWorker(this.redis.url, env, { fake: FAKE_ENGINE });
    this.workers.push(worker);
    return worker;
  }

  async gateway(env: Record<string, string> = {}, options: { waitReady?: boolean } = {}): Promise<GatewayProcess> {
    const gateway = await startGateway(this.redis.url, env, options);
    this.gateways.push(gateway);
    return gateway;
  }

  /** Output of every process, for a failing test's message. */
  logs(): string {
    return [...this.gateways, ...this.workers].map((p) => `--- ${p.process.name} ${p.process.pid}\n${p.process.output()}`).join('\n');
  }

  async stop(): Promise<void> {
    await Promise.all([...this.gateways, ...this.workers].map((p) => p.process.stop(3_000)));
    await this.redis.stop();
  }
}
