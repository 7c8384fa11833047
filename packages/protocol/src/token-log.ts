import { decodeGatewayMessage, type GatewayEntry } from './gateway-message.js';

/**
 * The per-request token log: a Redis Stream holding every entry a request's workers published, in
 * sequence order, stream id `<seq>-1` (so a range read by sequence number is a plain XRANGE). Workers
 * write a step's entries with {@link WRITE_ENTRIES_SCRIPT}, its appends and its PUBLISH in one command;
 * gateways read it only to repair a gap and to resume a stream.
 */

/** Stream id of the entry with sequence number `seq`. */
export function logEntryId(seq: number): string {
  return `${seq}-1`;
}

/** Sequence number of a stream id written by {@link logEntryId}. */
export function seqOfLogEntryId(id: string): number {
  return Number.parseInt(id, 10);
}

/** The one field of each stream entry: the entry's JSON. */
export const LOG_FIELD = 'e';

/**
 * The entries of an `XRANGE` reply of a token log, in order, validated as live messages are (one
 * decode for the whole range). Throws on a malformed entry.
 */
export function decodeLogRange(range: ReadonlyArray<[id: string, fields: string[]]> | null | undefined): GatewayEntry[] {
  const json = (range ?? []).map(([, fields]) => fields[fields.indexOf(LOG_FIELD) + 1] ?? 'null');
  return json.length === 0 ? [] : decodeGatewayMessage(`{"workerId":"log","entries":[${json.join(',')}]}`).entries;
}

/**
 * Writes entries as one command: appends to the logs of any number of requests, then publishes to any
 * number of channels (a worker's whole step: its requests' entries, then one message per gateway).
 * Each append is fenced by attempt: only the request's current attempt may write (a worker that
 * merely looked dead and came back cannot); it sets the log's and the meta's TTL, and the worker id
 * when the entries hold its `accepted`. The appends come before the publishes, so an entry a gateway
 * sees live is in its log already; a write Redis refuses (out of memory) ends that request's append
 * only — the others, and the publishes, still go (as when each append was its own command).
 *
 * KEYS: meta, log of each request. ARGV: the request count, then for each request attempt, maxlen,
 * ttlMs, workerId ('' = leave), its pair count and its seq, json pairs; then channel, message pairs to
 * the end. Returns one reply per request — 1 appended, 0 fenced out, or the message of the error that
 * stopped its append (what it wrote before stays, as a failed command's would) — then the list of each
 * publish's receivers.
 *
 * One script for the step, not one per request: the worker's router spent 13 % less CPU on a step of 8
 * requests (23 % on 32) and made 27 % fewer scavenges (30 %) (docs/durable-streams.md). Its keys span the
 * step's requests, which a Redis Cluster refuses across hash slots: a cluster port calls it once per
 * slot (each request's keys share one by their hash tag).
 */
export const WRITE_ENTRIES_SCRIPT = `
local function refused(reply)
  if type(reply) == 'table' then return reply.err end
end
local requests = tonumber(ARGV[1])
local replies = {}
local a = 2
for r = 1, requests do
  local meta, log = KEYS[2 * r - 1], KEYS[2 * r]
  local attempt, maxlen, ttl, workerId = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local first = a + 5
  a = first + 2 * tonumber(ARGV[a + 4])
  local current = redis.call('HGET', meta, 'attempt')
  if current and current ~= attempt then
    replies[r] = 0
  else
    local failed
    for i = first, a - 1, 2 do
      failed = refused(redis.pcall('XADD', log, 'MAXLEN', '~', maxlen, ARGV[i] .. '-1', 'e', ARGV[i + 1]))
      if failed then break end
    end
    failed = failed or refused(redis.pcall('PEXPIRE', log, ttl))
    if current and not failed then
      failed = refused(redis.pcall('PEXPIRE', meta, ttl))
      if not failed and workerId ~= '' then failed = refused(redis.pcall('HSET', meta, 'workerId', workerId)) end
    end
    replies[r] = failed or 1
  end
end
local receivers = {}
for i = a, #ARGV, 2 do
  receivers[#receivers + 1] = redis.call('PUBLISH', ARGV[i], ARGV[i + 1])
end
replies[requests + 1] = receivers
return replies
`;

/**
 * Writes a new request's meta and its TTL as one command. KEYS: meta. ARGV: ttlMs, then field, value
 * pairs. Returns 1. (A MULTI of HSET + PEXPIRE did the same in four commands; on the gateway's queue
 * connection, where BullMQ defines its scripts, building the MULTI cost ~40 µs of CPU a request.)
 */
export const CREATE_META_SCRIPT = `
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
`;

/**
 * Records a delivery's usage in the request's meta, so that each token counts once under the request's
 * API key whichever gateways deliver it (the first, then a resumed stream, perhaps several times):
 * each delivery reports its totals through the last event it handled and records what passes what is
 * recorded. KEYS: meta. ARGV: prompt tokens, completion tokens. Returns the new prompt and completion
 * tokens; all of them when the meta is gone (no other delivery can follow).
 */
export const RECORD_USAGE_SCRIPT = `
local prompt, completion = tonumber(ARGV[1]), tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then return {prompt, completion} end
local recorded = redis.call('HMGET', KEYS[1], 'usagePrompt', 'usageCompletion')
local newPrompt = math.max(0, prompt - tonumber(recorded[1] or '0'))
local newCompletion = math.max(0, completion - tonumber(recorded[2] or '0'))
if newPrompt > 0 then redis.call('HSET', KEYS[1], 'usagePrompt', prompt) end
if newCompletion > 0 then redis.call('HSET', KEYS[1], 'usageCompletion', completion) end
return {newPrompt, newCompletion}
`;

/**
 * Moves a request's live route. KEYS: meta. ARGV: channel ('' = detach), from ('' = whatever the route
 * is now; else only while the route is still `from`), now (ms). Returns 1 when moved, 0 when the meta is
 * gone or the route had already moved.
 */
export const ROUTE_SCRIPT = `
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'channel') ~= ARGV[2] then return 0 end
local detachedAt = ''
if ARGV[1] == '' then detachedAt = ARGV[3] end
redis.call('HSET', KEYS[1], 'channel', ARGV[1], 'detachedAt', detachedAt)
return 1
`;

/**
 * Moves a request to a new attempt because its worker was lost (or hands it over while draining):
 * fences the old attempt out of the log, and routes its live entries. KEYS: meta. ARGV: the attempt the
 * caller saw, the lost worker's id, max migrations, the channel, now (ms, for a detach only the worker
 * knew of), who moves it (ARGV[6], below), and optionally a channel and a message published when the
 * move is made (ARGV[7], ARGV[8]; '' publishes nothing): in the same step, so that it reaches a
 * subscriber ahead of anything published after the move. Who moves it:
 * - a gateway (`gateway`): its own channel (its session's client reads it there) or '' (a detached
 *   request it found); a route another gateway took since it read the meta (a resume there) stays — a
 *   stale session's move used to take the stream from the gateway its client reads, and a detached
 *   request's move to detach again a request resumed meanwhile;
 * - a worker (`worker`, its drain or its recovery of a dead worker's job): '' when its own view is
 *   detached (it may be the only one to know the gateway is gone: the meta is detached from now on),
 *   else the route stays as the meta has it (a view that missed a detach must not undo it).
 * Returns [1, new attempt] when moved, [0, current attempt] when someone else moved it already (or the
 * worker is not the lost one), [2, current attempt] when the request used up its migrations, [3, 0]
 * when the meta is gone.
 */
export const MIGRATE_SCRIPT = `
local attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt'))
if not attempt then return {3, 0} end
if attempt ~= tonumber(ARGV[1]) then return {0, attempt} end
local worker = redis.call('HGET', KEYS[1], 'workerId')
if worker and worker ~= '' and worker ~= ARGV[2] then return {0, attempt} end
if attempt > tonumber(ARGV[3]) then return {2, attempt} end
local channel = redis.call('HGET', KEYS[1], 'channel')
local keep
if ARGV[6] == 'worker' then
  keep = ARGV[4] ~= ''
else
  keep = channel and channel ~= '' and channel ~= ARGV[4]
end
if keep then
  redis.call('HSET', KEYS[1], 'attempt', attempt + 1, 'workerId', '')
elseif ARGV[4] == '' then
  -- Moved while detached: it stays detached, its grace counted from when it detached (or from now,
  -- ARGV[5], if only the worker knew).
  local detached = redis.call('HGET', KEYS[1], 'detachedAt')
  if not detached or detached == '' then detached = ARGV[5] end
  redis.call('HSET', KEYS[1], 'attempt', attempt + 1, 'workerId', '', 'channel', '', 'detachedAt', detached)
else
  redis.call('HSET', KEYS[1], 'attempt', attempt + 1, 'workerId', '', 'channel', ARGV[4], 'detachedAt', '')
end
if ARGV[7] and ARGV[7] ~= '' then redis.call('PUBLISH', ARGV[7], ARGV[8]) end
return {1, attempt + 1}
`;

/**
 * Sets a waiting job's cancel marker only while the request still routes to the cancelling gateway: a
 * client that resumed it on another gateway (its route moved there) still wants the work, so the old
 * connection's cancel is dropped (the workers fence a running request's cancel by the same route).
 * Checked and set in one step, so that a resume cannot slip in between. A request without a meta (gone:
 * nothing can resume it) is cancelled. KEYS: meta, marker. ARGV: the gateway's channel, the reason, the
 * marker's TTL (ms). Returns 1 when set, 0 when the route moved.
 */
export const CANCEL_IF_ROUTED_SCRIPT = `
local channel = redis.call('HGET', KEYS[1], 'channel')
if channel and channel ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
`;
