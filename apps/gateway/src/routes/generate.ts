import { randomUUID } from 'node:crypto';
import type { Context } from 'hono';
import { batchRequestId, endsRequest, type JobInput, type RequestMeta, type StreamFormat } from '@sluice/protocol';
import type { AppDeps } from '../app.js';
import { ClientPresence } from '../client-presence.js';
import { fromStore, GatewayError } from '../errors.js';
import { checkPrompt } from '../prompt-tokens.js';
import { checkInputLimits } from '../openai/input-limits.js';
import { readJsonBody } from '../read-json-body.js';
import { parseChatRequest, parseCompletionRequest, type Endpoint } from '../openai/request-schemas.js';
import { ResponseFormat, type ResponseFormatOptions } from '../openai/response-format.js';
import { PromptBatch } from '../prompt-batch.js';
import type { RequestSession } from '../request-session.js';
import type { ModelTokenizer } from '../tokenizer-cache.js';
import { systemFingerprint } from '../version.js';
import { CompleteResponder } from '../responders/complete-responder.js';
import type { ResponderContext } from '../responders/responder-context.js';
import { StreamResponder } from '../responders/stream-responder.js';
import { RequestTiming } from '../responders/request-timing.js';
import { IDEMPOTENCY_KEY_PATTERN, type ClaimedKey, type IdempotencyStore, type TakenKey } from '../idempotency-store.js';
import { takeOver, takenOverObserver, type DeliveryEndings } from '../take-over.js';

import type { AppEnv } from '../app.js';
import { noObserver } from '../responders/responder-context.js';

/**
 * `POST /v1/chat/completions` and `POST /v1/completions`: validate, admit, enqueue, then let a
 * responder turn the session's events into the reply. Every refusal before the 200 is thrown as a
 * GatewayError and becomes an HTTP error in the app's error handler.
 */
export function generateHandler(deps: AppDeps, endpoint: Endpoint) {
  const { config, sessions, jobs, registry, heartbeats, hooks, channel } = deps;
  return async (c: Context<AppEnv>): Promise<Response> => {
    const receivedAt = Date.now();
    const receivedAtMono = performance.now();
    const res = c.env.outgoing;
    // Watched before the first await (the body, the tokenizer, the key's limits, the enqueue).
    const client = new ClientPresence(res);
    const body = await readJsonBody(c.env.incoming, res, config.maxBodyBytes);
    const request = endpoint === 'chat' ? parseChatRequest(body) : parseCompletionRequest(body);
    checkInputLimits(request, config.access);
    const idempotencyKey = idempotencyKeyOf(c);
    if (deps.drainPhase() === 'refusing') throw new GatewayError('shutting_down');
    const served = registry.requireModel(request.model);
    const apiKey = c.get('apiKey');
    const admission = deps.access?.admission;
    if (apiKey !== undefined) admission?.checkModel(apiKey, request.model);
    const prompts = request.prompts ?? [request.input];
    if (sessions.queuedCount + prompts.length > config.maxQueuedRequests) throw new GatewayError('queue_full');
    // Held while the request is admitted: the awaits below (its tokenizer, its key's limits) let other
    // requests pass the same check meanwhile, which filled the queue past its bound (10 of 10 admitted
    // at MAX_QUEUED_REQUESTS=2 with a key with limits).
    const releaseQueued = sessions.reserveQueued(prompts.length);
    // Claimed below when the request carries an Idempotency-Key; given back if it is refused before its
    // job is enqueued, so that a retry with the same key is admitted afresh.
    let claim: ClaimedKey | undefined;
    let enqueued = false;
    try {
      // Tokenized here, not on a worker: a prompt that cannot fit is a 400 before the 200 under any load.
      const tokenizer = await deps.tokenizers.forModel(served);
      // Gone before anything was taken: refused as a client that left mid-body is (nobody gets the reply).
      if (client.gone) throw new GatewayError('client_closed');
      // A refusal of prompt k of a batch names it: `prompt[k]`.
      const checked = prompts.map((input, k) =>
        checkPrompt({ ...request, input }, tokenizer, served, request.prompts === undefined ? undefined : `prompt[${k}]`),
      );
      const promptIds = checked.map((prompt) => prompt.ids);

      const formatOptions: ResponseFormatOptions = { fingerprint: systemFingerprint(request.model) };
      if (request.echo === true) formatOptions.echo = echoTexts(prompts, request.n, tokenizer);

      // The client's id (`X-Request-Id`, checked by the app's middleware) is for logs and the reply; it
      // need not be unique, so the job, the session and the pub/sub entries use an id of our own.
      const requestId = c.get('requestId');
      // Our own id serves as both when the client sent none: then logs, reply and job id agree.
      const freshJobId = c.req.header('x-request-id') === requestId ? randomUUID() : requestId;
      // A key seen before names the request it admitted: that request is delivered here from the start
      // of its log, neither generated nor charged again (a batch of prompts is not replayed: its key is
      // not recorded).
      let replayed: ReplayTarget | undefined;
      if (idempotencyKey !== undefined && prompts.length === 1 && deps.idempotency !== undefined) {
        ({ claim, replayed } = await idempotentAdmission(
          deps.idempotency,
          deps,
          apiKey?.hash ?? '',
          idempotencyKey,
          endpoint,
          body,
          freshJobId,
        ));
      }
      const jobId = replayed?.jobId ?? freshJobId;
      // The key's limits, last of the refusals: a granted request settles when it ends.
      const grant =
        replayed !== undefined || apiKey === undefined || admission === undefined
          ? undefined
          : await admission.admit(apiKey, request, checked, jobId, res);
      if (client.gone) {
        // Gone while the key's limits were decided: nothing is enqueued, and the grant (token
        // reservation, stream slot) is settled at once, as if the request had used nothing.
        if (grant !== undefined) admission?.release(grant);
        throw new GatewayError('client_closed');
      }
      if (replayed !== undefined) hooks.requestReplayed?.(request.stream);
      const started =
        replayed === undefined
          ? (hooks.requestStarted?.({
              requestId,
              jobId,
              endpoint,
              model: request.model,
              stream: request.stream,
              receivedAt: receivedAtMono,
            }) ?? noObserver())
          : undefined;
      // Only a stream can be resumed (and a batch of prompts cannot: see PromptBatch).
      const graceMs =
        replayed !== undefined
          ? replayed.meta.graceMs
          : request.stream && prompts.length === 1
            ? Math.min(request.resumeGraceMs ?? config.resumeGraceMs, config.maxResumeGraceMs)
            : 0;
      // A replay is one more delivery of a request counted where it was admitted, as a resume is.
      const endings: DeliveryEndings = {};
      const observer =
        started === undefined
          ? takenOverObserver(hooks, endings)
          : grant === undefined || admission === undefined
            ? started
            : admission.observe(grant, started, graceMs);
      // Usage so far on every chunk: read from the responder, which counts the tokens it writes.
      let responderUsage = () => ({ promptTokens: 0, completionTokens: 0 });
      if (request.continuousUsage === true && request.stream) formatOptions.liveUsage = () => responderUsage();
      const ctx: ResponderContext = {
        requestId,
        // A batch of P prompts answers with P × n choices.
        request: prompts.length > 1 ? { ...request, n: prompts.length * request.n } : request,
        format: new ResponseFormat(endpoint, jobId, request.model, request.includeUsage, replayed?.meta.format.created, formatOptions),
        receivedAt,
        retryAfterS: config.retryAfterS,
        hooks,
        observer,
        timing: new RequestTiming(receivedAtMono, performance.now()),
      };
      let opened: RequestSession[] = [];
      const responder = request.stream
        ? new StreamResponder(ctx, res, heartbeats, {
            headersWaitMs: config.headersWaitMs,
            streamIntervalMs: config.streamIntervalMs,
            maxBufferBytes: config.maxStreamBufferBytes,
            // A client that does not read is treated as one that left (its work detached within a grace).
            onGiveUp: () => {
              let detached = false;
              for (const session of opened) detached = sessions.clientLeft(session) || detached;
              return detached;
            },
          })
        : new CompleteResponder(ctx);
      if (responder instanceof StreamResponder) responderUsage = () => responder.usage;

      if (replayed !== undefined) {
        // The request's reply from the first event of its log on, wherever it runs (or ran) now. It takes
        // no place in this gateway's queue beyond its session's (counted there until its `accepted`).
        releaseQueued();
        if (request.stream) endings.active = hooks.resumedStreamOpened?.();
        const taken = takeOver(deps, {
          jobId,
          meta: replayed.meta,
          cursor: -1,
          last: undefined,
          responder,
          client,
          key: apiKey,
          admission,
          endings,
        });
        opened = [taken.session];
        await taken.done;
        return await responder.reply;
      }

      const deadlineAt = receivedAt + config.requestTimeoutMs;
      const batch =
        prompts.length > 1
          ? new PromptBatch(
              request.n,
              promptIds.reduce((sum, ids) => sum + ids.length, 0),
              (event) => responder.handle(event),
              (session) => sessions.cancel(session, 'client_closed'),
            )
          : undefined;
      // Prompt k of a batch runs as its own job; the first keeps the reply's id.
      const jobIds = prompts.map((_, k) => batchRequestId(jobId, k));
      opened = jobIds.map((id, k) => {
        const session = sessions.open(id, deadlineAt, batch?.listenerFor(k) ?? ((event) => responder.handle(event)), {
          graceMs,
          // A revoke of the key ends the session (auth/key-revocation.ts).
          owner: apiKey?.hash,
        });
        batch?.add(session);
        return session;
      });
      // Counted as queued by their sessions from here.
      releaseQueued();
      // The stream owns its cleanup: a client that leaves at any stage cancels the work (or, with a
      // resume grace, leaves it running for a resume from any gateway). One that leaves while the job is
      // being enqueued is answered at once and its work cancelled as soon as the enqueue is done (a
      // cancel sent before the job exists could miss it).
      const leave = () => {
        if (responder.done) return;
        if (responder instanceof StreamResponder) responder.clientClosed(graceMs > 0);
        else responder.clientClosed();
        if (enqueued) for (const session of opened) sessions.clientLeft(session);
      };
      client.onLeave(leave);

      const format: StreamFormat = {
        endpoint,
        model: request.model,
        created: ctx.format.created,
        includeUsage: request.includeUsage,
        n: request.n,
        maxTokensParam: request.maxTokensParam,
        ...(request.continuousUsage === true && request.stream ? { continuousUsage: true } : {}),
        ...(prompts.length > 1 ? { prompts: prompts.length } : {}),
        ...(prompts.length === 1 && formatOptions.echo !== undefined ? { echo: formatOptions.echo[0] ?? '' } : {}),
      };
      try {
        await Promise.all(
          promptIds.map((promptTokenIds, k) =>
            jobs.submit(
              {
                requestId: jobIds[k]!,
                correlationId: requestId,
                channel,
                model: request.model,
                input: { kind: 'tokens', promptTokenIds },
                sampling: { ...request.sampling, maxTokens: checked[k]!.maxTokens },
                defaultMaxTokens: request.defaultMaxTokens,
                resumeGraceMs: graceMs,
                enqueuedAt: Date.now(),
                deadlineAt,
              },
              format,
              c.get('apiKey')?.hash ?? '',
            ),
          ),
        );
      } catch (error) {
        for (const session of opened) sessions.release(session);
        const refusal = new GatewayError('store_unavailable', { message: 'The job queue is unavailable.', cause: error });
        // Tracked already: it ends as an error outcome, and the app's error handler counts the refusal.
        observer.finished({ end: { outcome: 'error', code: refusal.code }, status: refusal.status, promptTokens: 0, completionTokens: 0 });
        throw refusal;
      }
      enqueued = true;
      // Kept as long as the request's meta: a retry within its retention finds it.
      if (claim !== undefined) {
        deps.idempotency?.keep(claim, Math.max(1, deadlineAt - Date.now()) + config.streamRetentionMs).catch((error: unknown) => {
          deps.logger.warn({ err: error, requestId }, 'keeping an idempotency key failed: it lapses in 30 s');
        });
      }
      observer.enqueued?.();
      if (client.gone) {
        for (const session of opened) sessions.clientLeft(session);
        return responder.reply;
      }
      responder.begin();
      return responder.reply;
    } finally {
      releaseQueued();
      if (claim !== undefined && !enqueued) {
        deps.idempotency?.release(claim).catch((error: unknown) => {
          deps.logger.warn({ err: error, requestId: c.get('requestId') }, 'freeing an idempotency key failed: it lapses in 30 s');
        });
      }
    }
  };
}

/** The request's `Idempotency-Key`, checked: 1–255 visible ASCII characters. */
function idempotencyKeyOf(c: Context<AppEnv>): string | undefined {
  const key = c.req.header('idempotency-key');
  if (key === undefined) return undefined;
  if (!IDEMPOTENCY_KEY_PATTERN.test(key)) {
    throw new GatewayError('invalid_request', {
      message: 'Idempotency-Key: must be 1 to 255 visible ASCII characters.',
      param: 'Idempotency-Key',
    });
  }
  return key;
}

/** A request admitted earlier under the same `Idempotency-Key`, whose answer this POST gets. */
interface ReplayTarget {
  jobId: string;
  meta: RequestMeta;
}

/**
 * What an `Idempotency-Key` makes of this POST: a new request, admitted under the key it claims, or a
 * replay of the request the key names. That request is replayed when it has the same route and body
 * (else 422) and an answer to deliver — it runs, or finished with every choice's `stop` or `length`.
 * One that left none (it failed, was cancelled, or its meta expired) frees the key for this POST,
 * unless a concurrent retry took it first (409). 409 too while the key's request is still being
 * admitted (or its gateway died doing so: the claim lapses).
 */
async function idempotentAdmission(
  store: IdempotencyStore,
  deps: Pick<AppDeps, 'log' | 'jobs'>,
  owner: string,
  key: string,
  endpoint: Endpoint,
  body: unknown,
  freshJobId: string,
): Promise<{ claim?: ClaimedKey; replayed?: ReplayTarget }> {
  const found = await fromStore(store.claim(owner, key, endpoint, body, freshJobId));
  if (found.kind === 'claimed') return { claim: found };
  if (!found.sameRequest) throw new GatewayError('idempotency_key_reused');
  const replayed = await replayTarget(deps, endpoint, found);
  if (replayed !== undefined) return { replayed };
  const claim = await fromStore(store.reclaim(found, freshJobId));
  if (claim === undefined) throw new GatewayError('idempotency_conflict');
  return { claim };
}

/** The request a taken key names, if it has an answer to deliver (see {@link idempotentAdmission}). */
async function replayTarget(deps: Pick<AppDeps, 'log' | 'jobs'>, endpoint: Endpoint, found: TakenKey): Promise<ReplayTarget | undefined> {
  const meta = await fromStore(deps.log.meta(found.jobId));
  if (meta === undefined) {
    if (found.kept) return undefined;
    throw new GatewayError('idempotency_conflict');
  }
  if (meta.format.endpoint !== endpoint || meta.format.prompts !== undefined) throw new GatewayError('idempotency_conflict');
  // A cancelled request's choices end `abort` together, just before its `finish`.
  const tail = await fromStore(deps.log.tail(found.jobId, meta.format.n + 1));
  const last = tail.at(-1);
  if (last !== undefined && endsRequest(last)) {
    const answered = last.type === 'finish' && !tail.some((entry) => entry.type === 'text-end' && entry.finishReason === 'abort');
    return answered ? { jobId: found.jobId, meta } : undefined;
  }
  // Not ended yet: no answer comes when a cancel marker waits for it (its client left without a resume
  // grace, a timeout, a cancel: the `abort` reaches the log a step later, or once the queue removed the
  // job; a queue timeout's 503 goes out before both), nor, with nothing logged, when no job of it is in
  // the queue (its gateway wrote the meta but died before the add, a moment later, reached Redis; or a
  // cancel removed it). A client that retries at once wants an answer, not that one.
  const job = await fromStore(deps.jobs.jobState(found.jobId));
  if (job.cancelled || (last === undefined && !job.queued)) return undefined;
  return { jobId: found.jobId, meta };
}

/**
 * With `echo`, the text each choice starts with (choice index = prompt index × n + choice): a text
 * prompt as sent, token ids decoded.
 */
function echoTexts(prompts: readonly JobInput[], n: number, tokenizer: ModelTokenizer): string[] {
  return prompts.flatMap((input) => {
    const text = input.kind === 'text' ? input.prompt : input.kind === 'tokens' ? tokenizer.decode(input.promptTokenIds) : '';
    return Array.from({ length: n }, () => text);
  });
}
