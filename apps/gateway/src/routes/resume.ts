import type { Context } from 'hono';
import type { AppDeps, AppEnv } from '../app.js';
import { ClientPresence } from '../client-presence.js';
import { fromStore, GatewayError } from '../errors.js';
import { batchRequestId, endsRequest, type GatewayEntry, type RequestMeta } from '@sluice/protocol';
import type { Endpoint, ParsedRequest } from '../openai/request-schemas.js';
import { logprobsTextLength, ResponseFormat, type UsageNumbers } from '../openai/response-format.js';
import type { ResponderContext } from '../responders/responder-context.js';
import { StreamResponder } from '../responders/stream-responder.js';
import { SSE_HEADERS } from '../sse-writer.js';
import { systemFingerprint } from '../version.js';
import { takeOver, takenOverObserver, type DeliveryEndings } from '../take-over.js';

/** The job id inside a chunk id (`chatcmpl-<id>` / `cmpl-<id>`), or undefined when it is not one of ours. */
function jobIdOf(endpoint: Endpoint, chunkId: string): string | undefined {
  const prefix = endpoint === 'chat' ? 'chatcmpl-' : 'cmpl-';
  return chunkId.startsWith(prefix) && chunkId.length > prefix.length ? chunkId.slice(prefix.length) : undefined;
}

/**
 * `Last-Event-ID` (what a browser's EventSource sends) or `starting_after`, and which of them it came
 * from; -1 = from the start. Event ids are safe integers: a larger one would be read rounded (and
 * echoed so), so it is refused as any other id that is not one.
 */
function cursorOf(c: Context<AppEnv>): { cursor: number; param: 'Last-Event-ID' | 'starting_after' } {
  const header = c.req.header('last-event-id');
  const [raw, param] =
    header !== undefined && header !== '' ? [header, 'Last-Event-ID' as const] : [c.req.query('starting_after'), 'starting_after' as const];
  if (raw === undefined || raw === '') return { cursor: -1, param };
  const cursor = Number(raw);
  if (!/^(-1|0|[1-9]\d{0,15})$/.test(raw) || !Number.isSafeInteger(cursor)) {
    throw new GatewayError('invalid_request', { message: `${param}: must be an event id of this stream (an integer ≥ -1).`, param });
  }
  return { cursor, param };
}

function notFound(id: string): GatewayError {
  return new GatewayError('not_found', { message: `No stream '${id}' (unknown, or its retention ended).`, param: 'id' });
}

/**
 * Whether the caller may steer the request: the same API key that made it (or, on a gateway without
 * keys, anyone). Another key's request answers 404, as an unknown one does: its existence is not told.
 */
function ownedByCaller(c: Context<AppEnv>, meta: RequestMeta): boolean {
  return (meta.owner ?? '') === (c.get('apiKey')?.hash ?? '');
}

/**
 * `GET /v1/chat/completions/{id}?stream=true` (and `/v1/completions/{id}`): the rest of a stream after
 * a cursor, from whichever gateway the client reaches, while the request runs and for the retention
 * after it ended. Live delivery moves here; what was written before comes from the token log.
 *
 * `HEAD` (which Hono serves with this handler) answers what a GET would, status and headers, and
 * takes nothing over: HEAD is a safe method (RFC 9110 §9.3.2), sent by link checkers, proxies and
 * monitors, and a GET takes the stream over from the connection that holds it.
 */
export function resumeHandler(deps: AppDeps, endpoint: Endpoint) {
  const { sessions, log, heartbeats, config, hooks } = deps;
  return async (c: Context<AppEnv>): Promise<Response> => {
    const res = c.env.outgoing;
    // Watched before the first await (the meta, the log, the attach).
    const client = new ClientPresence(res);
    const chunkId = c.req.param('id') ?? '';
    const jobId = jobIdOf(endpoint, chunkId);
    if (jobId === undefined) throw notFound(chunkId);
    if (c.req.query('stream') !== 'true') {
      // (What the official client's `retrieve(id)` sends: stored completions are OpenAI's, not ours.)
      throw new GatewayError('invalid_request', {
        message:
          'stream: must be true. This route resumes a stream; stored completions (retrieving a finished answer as JSON) are not supported.',
        param: 'stream',
      });
    }
    const { cursor, param: cursorParam } = cursorOf(c);
    if (deps.drainPhase() === 'refusing') throw new GatewayError('shutting_down');
    const [meta, last] = await fromStore(Promise.all([log.meta(jobId), log.last(jobId)]));
    if (meta === undefined || meta.format.endpoint !== endpoint || !ownedByCaller(c, meta)) throw notFound(chunkId);
    const lastSeq = last?.seq ?? -1;
    if (cursor > lastSeq) {
      throw new GatewayError('invalid_request', {
        message: `The cursor ${cursor} is past the end of the stream (last event id ${lastSeq}).`,
        param: cursorParam,
      });
    }
    const { format } = meta;
    if (format.prompts !== undefined) {
      // Each prompt of the batch ran as its own request with its own log; this id's log holds only
      // the first prompt's choices, which would pass for the whole answer.
      throw new GatewayError('invalid_request', {
        message: `The stream of '${chunkId}' cannot be resumed: it answers a batch of ${format.prompts} prompts, whose streams are not resumable.`,
        param: 'id',
      });
    }
    if (c.req.method === 'HEAD') return c.body(null, 200, { ...SSE_HEADERS, 'X-Request-Id': c.get('requestId'), 'X-Stream-Id': chunkId });
    // What the events up to the cursor counted: usage on every chunk counts on from there, a key's
    // usage records the stream's totals (each token once, whichever gateways deliver it), and a
    // completion's logprobs count `text_offset` on from the text written before. (Whether a completion
    // asked for logprobs is not in its format: every completions resume reads.)
    const apiKey = c.get('apiKey');
    const admission = apiKey === undefined ? undefined : deps.access?.admission;
    const countsUsage = format.continuousUsage === true || admission !== undefined;
    const before =
      cursor >= 0 && (countsUsage || endpoint === 'completion')
        ? writtenBefore((await fromStore(log.read(jobId, 0, cursor))).entries, format.n)
        : writtenBefore([], format.n);
    // Gone before anything was taken over: nobody gets the reply, and the stream stays as it was.
    if (client.gone || res.destroyed) throw new GatewayError('client_closed');
    let responderUsage = () => ({ promptTokens: 0, completionTokens: 0 });
    const endings: DeliveryEndings = {};
    const request: ParsedRequest = {
      endpoint,
      model: format.model,
      input: { kind: 'tokens', promptTokenIds: [] },
      sampling: {},
      defaultMaxTokens: 'context',
      stream: true,
      includeUsage: format.includeUsage,
      n: format.n,
      logprobs: false,
      maxTokensParam: format.maxTokensParam,
      user: undefined,
      resumeGraceMs: meta.graceMs,
    };
    const ctx: ResponderContext = {
      requestId: c.get('requestId'),
      request,
      format: new ResponseFormat(endpoint, jobId, format.model, format.includeUsage, format.created, {
        fingerprint: systemFingerprint(format.model),
        ...(format.continuousUsage === true ? { liveUsage: () => responderUsage() } : {}),
        // Written with the `accepted` event: again only by a resume from before it.
        ...(format.echo === undefined ? {} : { echo: Array.from({ length: format.n }, () => format.echo!) }),
        textBefore: before.textLengths,
      }),
      receivedAt: Date.now(),
      retryAfterS: config.retryAfterS,
      hooks,
      // The request was counted where it started; a resume is one more delivery of it.
      observer: takenOverObserver(hooks, endings),
    };
    const responder: StreamResponder = new StreamResponder(ctx, res, heartbeats, {
      headersWaitMs: 0,
      streamIntervalMs: config.streamIntervalMs,
      maxBufferBytes: config.maxStreamBufferBytes,
      onGiveUp: () => sessions.clientLeft(taken.session),
    });
    if (countsUsage) {
      responder.usageSoFar(before.usage);
      responderUsage = () => responder.usage;
    }
    if (cursor === lastSeq && last !== undefined && endsRequest(last)) {
      // The client already has the request's last event: nothing is left but to say so.
      responder.endedAtCursor();
      hooks.streamResumed?.();
      return responder.reply;
    }
    // Counted among the gateway's active streams from the takeover to its end.
    endings.active = hooks.resumedStreamOpened?.();
    const taken = takeOver(deps, {
      jobId,
      meta,
      cursor,
      last,
      responder,
      client,
      // (The key is the request's: see ownedByCaller.)
      key: apiKey,
      admission,
      endings,
      attached: () => hooks.streamResumed?.(),
    });
    await taken.done;
    return responder.reply;
  };
}

/**
 * `POST /v1/chat/completions/{id}/cancel` (and `/v1/completions/{id}/cancel`), from any gateway. A
 * completions batch is cancelled whole: each of its prompts runs as its own request.
 */
export function cancelHandler(deps: AppDeps, endpoint: Endpoint) {
  const { jobs, log, config } = deps;
  return async (c: Context<AppEnv>): Promise<Response> => {
    // The cancel takes no body, and reads none: one over MAX_BODY_BYTES is refused as any route's
    // would be, and with any body the connection closes after the reply (Node would otherwise read
    // and discard it to keep the connection).
    const { incoming, outgoing } = c.env;
    const declared = Number(incoming.headers['content-length'] ?? 0);
    if (declared > 0 || incoming.headers['transfer-encoding'] !== undefined) outgoing.shouldKeepAlive = false;
    if (declared > config.maxBodyBytes) throw new GatewayError('request_too_large');
    const chunkId = c.req.param('id') ?? '';
    const jobId = jobIdOf(endpoint, chunkId);
    if (jobId === undefined) throw notFound(chunkId);
    const meta = await fromStore(log.meta(jobId));
    if (meta === undefined || meta.format.endpoint !== endpoint || !ownedByCaller(c, meta)) throw notFound(chunkId);
    const requestIds = Array.from({ length: meta.format.prompts ?? 1 }, (_, k) => batchRequestId(jobId, k));
    await fromStore(
      Promise.all(
        requestIds.map(async (id, k) => {
          const requestMeta = k === 0 ? meta : await log.meta(id);
          // A prompt whose meta expired has nothing left to stop.
          if (requestMeta !== undefined) await jobs.cancelRequest(id, requestMeta);
        }),
      ),
    );
    return c.json({ id: chunkId, object: endpoint === 'chat' ? 'chat.completion' : 'text_completion', cancelled: true });
  };
}

/**
 * What a stream's events wrote: the usage they carried (the prompt's tokens, from its `accepted`
 * entry, and the completion tokens of its deltas) and, by choice index, the length of the text their
 * logprobs covered, as `text_offset` counts it. Exact while the log still holds the stream's first
 * entries (`STREAM_MAX_ENTRIES`).
 */
function writtenBefore(entries: readonly GatewayEntry[], n: number): { usage: UsageNumbers; textLengths: number[] } {
  let promptTokens = 0;
  let completionTokens = 0;
  const textLengths = Array.from({ length: n }, () => 0);
  for (const entry of entries) {
    if (entry.type === 'accepted') promptTokens = entry.promptTokens;
    else if (entry.type === 'text-delta') {
      completionTokens += entry.tokens;
      if (entry.logprobs !== undefined) textLengths[entry.index] = (textLengths[entry.index] ?? 0) + logprobsTextLength(entry.logprobs);
    }
  }
  return { usage: { promptTokens, completionTokens }, textLengths };
}
