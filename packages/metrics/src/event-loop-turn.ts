let turn = 0;
let ending = false;

/**
 * The current event-loop turn's number: the same until the microtasks queued by this turn's work have
 * run, then one more. One gateway message (one engine step of every request it carries) is delivered
 * within one turn, so the chunks one step wrote for a request share a turn whatever their count.
 */
export function eventLoopTurn(): number {
  if (!ending) {
    ending = true;
    queueMicrotask(() => {
      ending = false;
      turn++;
    });
  }
  return turn;
}
