/**
 * A step sink for tests (`EngineOptions.stepSink`): takes every text delta and counts its tokens per
 * request; when a request finishes it posts the count (and how many steps it saw end), and it echoes
 * every message the host sends. Nothing else is taken.
 */
export function createStepSink(options, post) {
  const tokens = new Map();
  let steps = 0;
  return {
    take(requestId, event) {
      if (event.type === 'text-delta') {
        tokens.set(requestId, (tokens.get(requestId) ?? 0) + event.tokenIds.length);
        return true;
      }
      // After the message carrying the finish.
      if (event.type === 'finish')
        queueMicrotask(() => post({ requestId, tokens: tokens.get(requestId) ?? 0, steps, label: options.label }));
      return false;
    },
    endStep() {
      steps++;
    },
    onMessage(message) {
      post({ echo: message });
    },
    async close() {},
  };
}
