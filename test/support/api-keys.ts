/** The `keys` command (`npm run keys`), run as its own process, as an operator would. */
import { execFile } from 'node:child_process';
import { fileURLToPath } from 'node:url';

const KEYS_CLI = fileURLToPath(new URL('../../apps/gateway/dist/cli/keys.js', import.meta.url));

export interface KeysResult {
  code: number;
  stdout: string;
  stderr: string;
}

export function runKeys(redisUrl: string, args: string[], env: Record<string, string> = {}): Promise<KeysResult> {
  return new Promise((resolve) => {
    execFile(process.execPath, [KEYS_CLI, ...args], { env: { ...process.env, REDIS_URL: redisUrl, ...env } }, (error, stdout, stderr) => {
      const code = error === null ? 0 : typeof error.code === 'number' ? error.code : 1;
      resolve({ code, stdout, stderr });
    });
  });
}

/** `keys create`; returns the key (the command's whole stdout, one line). */
export async function createKey(redisUrl: string, args: string[], env: Record<string, string> = {}): Promise<string> {
  const result = await runKeys(redisUrl, ['create', ...args], env);
  if (result.code !== 0) throw new Error(`keys create ${args.join(' ')} failed (${result.code}): ${result.stderr}`);
  return result.stdout.trimEnd();
}
