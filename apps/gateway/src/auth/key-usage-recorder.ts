import type { AuthFailure, KeyRefusal } from '@sluice/metrics';

/**
 * Where access control reports per-key usage (main.ts wires `@sluice/metrics`' KeyUsageMetrics;
 * tests leave it out). Calls are synchronous and must never throw.
 */
export interface KeyUsageRecorder {
  admitted(name: string): void;
  used(name: string, promptTokens: number, completionTokens: number): void;
  refused(name: string, reason: KeyRefusal): void;
  authFailed(reason: AuthFailure): void;
}

export const noKeyUsage: KeyUsageRecorder = { admitted() {}, used() {}, refused() {}, authFailed() {} };
