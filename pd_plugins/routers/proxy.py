"""Serve one client request: admit, schedule, run the engine flow, relay the answer, fail over.

The attempts and their failover rules are failover.py's; every leg has a timeout. A request the
front server read, on a flow whose legs follow one another (vLLM pull, the pools) or go out
together (SGLang), is served from the connections' callbacks (exchange.py) until something must
wait; the rest runs here, in the request's task."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any, Awaitable, Callable, Sequence

import aiohttp
import msgspec
from aiohttp import web

from pd_plugins.routers import accounting
from pd_plugins.routers.accounting import DecodeCharges
from pd_plugins.routers.config import RouterConfig
from pd_plugins.routers.kv_quarantine import KvQuarantine
from pd_plugins.routers.failover import Tries
from pd_plugins.routers.flows import Attempt, PdFlow
from pd_plugins.routers.flows.base import one_token_body
from pd_plugins.routers.metrics import RouterMetrics
from pd_plugins.routers.policy import Decision, PolicyContext, RequestInfo, Scheduler
from pd_plugins.routers.policy.base import uncached_tokens
from pd_plugins.routers.policy.latency_model import OnlineLinearFit
from pd_plugins.routers.request import (BadRequest, ClientRequest, LegBody, leg_dict,
                                        tokenize_deferred)
from pd_plugins.routers.replica_channels import ReplicaShare
from pd_plugins.routers.sessions import SessionTable
from pd_plugins.routers.stream_relay import SseRelay
from pd_plugins.routers.traffic_record import Measured, TrafficRecorder
from pd_plugins.routers.http_client import Response, UpstreamError, UpstreamTimeout
from pd_plugins.routers.errors import error_body, error_response
from pd_plugins.routers.exchange import Exchange
from pd_plugins.routers.http_server import (ClientHttp, ClientOut, FastRequest, FastStreamResponse,
                                            answered, header_lines, stream_response)
from pd_plugins.routers.upstream import (Pools, RequestRefused, WorkerFailed, answer_params,
                                        json_answer, open_leg, stream_begun, whole_leg)
from pd_plugins.vocab.expert_signature import ExpertSignature
from pd_plugins.vocab.transfer_params import kv_verdict_in_answer, pd_section_of, stored_tokens_of

log = logging.getLogger("pd_router.proxy")
_encode = msgspec.json.Encoder().encode
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
SSE_HEAD = header_lines(SSE_HEADERS) + b"x-pd-route: %b\r\n"  # the front server's, as bytes
STAGE_KEY = "pd_stage"  # on the aiohttp request: prefill | decode | answer, for client_gone
MEASURED_KEY = "pd_measured"  # on the aiohttp request: what the traffic record gets (Measured)


class ClientTooSlow(Exception):
    """A write to the client did not complete within timeouts.client_write_s."""


class Proxy:
    def __init__(self, config: RouterConfig, scheduler: Scheduler, ctx: PolicyContext,
                 flow: PdFlow, metrics: RouterMetrics, pools: Pools,
                 sessions: SessionTable | None = None, sharing: ReplicaShare | None = None,
                 model: str = "") -> None:
        self.config, self.scheduler, self.ctx = config, scheduler, ctx
        # the model group this proxy serves, first in x-pd-route ("": the one unnamed group)
        self._model_tag = f"model={model}, " if model else ""
        self.model = model
        self.recorder: TrafficRecorder | None = None  # set by the router (traffic_record)
        self.kv_quarantine: KvQuarantine | None = None  # set by the router (health.kv_verify)
        # pull flow: decode leg sent -> first token, over the prompt tokens the decode lacks: the
        # KV transfer, the first step and the leg's own cost (GET /admin/calibration exports it)
        latency = config.latency
        self.decode_first = OnlineLinearFit(0.0, latency.kv_bytes_per_token / latency.link_bytes_per_s
                                            if latency.link_bytes_per_s > 0 else 0.0)
        # sharing: what the other router replicas learn of each served turn (replica_sync.py)
        self.sessions, self.sharing = sessions, sharing
        self.flow, self.metrics, self.pools = flow, metrics, pools
        self.timeouts = config.timeouts
        self.record_prefixes = scheduler.uses_prefix_index
        # Request ids: a random per-process prefix and a counter (unique across routers, cheap).
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._ok = {d: metrics.requests.labels(d, "ok") for d in ("disaggregated", "local")}
        self._releases: set[asyncio.Task] = set()  # KV releases for clients that left (_release)

    # -- the request ----------------------------------------------------------------------
    def serve(self, http: ClientHttp, request: ClientRequest, path: str
              ) -> Awaitable[ClientOut] | Exchange:
        """The answer, to be awaited; or, for a request the front server read on a flow whose
        legs follow one another or go out together, an Exchange that answers it from the
        connections' callbacks (exchange.py). Not a coroutine itself: most requests (no traffic
        record, a prompt tokenized already) start right away."""
        if request.deferred is None and self.recorder is None:
            if (self.flow.sequential or self.flow.alongside) and type(http) is FastRequest:
                return Exchange.begin(self, http, request, path)
            return self._serve(http, request, path)
        return self._serve_prepared(http, request, path)

    async def _serve_prepared(self, http: ClientHttp, request: ClientRequest,
                              path: str) -> ClientOut:
        """serve() for a long text prompt (tokenized here, off the event loop) or a request
        the traffic record follows."""
        if request.deferred is not None:
            try:
                await tokenize_deferred(request)
            except BadRequest as bad:
                self.metrics.rejections.labels("bad_request").inc()
                return error_response(bad.status, bad.message, bad.param)
        if self.recorder is None:
            return await self._serve(http, request, path)
        measured = http[MEASURED_KEY] = Measured(time.time())
        # the group's name, not the client's: the planner and the calibration key the unnamed
        # group "" however its clients spell the model (an adapter name is its base model's group)
        model = self.model
        self.recorder.started(model, request.info, self.ctx.block_size, measured)  # in flight
        status = 499  # the client left (the handler was cancelled)
        try:
            response = await self._serve(http, request, path)
            status = response.status
            return response
        finally:  # queued for the record's writer thread: no I/O, no encoding here
            self.recorder.record(model, request.info, self.ctx.block_size, measured, status,
                                 request.info.turn if self.sessions is not None else None)

    def _serve(self, http: ClientHttp, request: ClientRequest, path: str
               ) -> Awaitable[ClientOut]:
        """The request's attempts (a coroutine), or its answer made already, awaitable."""
        started = time.monotonic()
        tries = self.begin(http, request, path)
        if not isinstance(tries, Tries):
            return answered(tries)
        return self.attempts(http, tries, started)

    def begin(self, http: Any, request: ClientRequest, path: str) -> Tries | web.Response:
        """Admission and the first attempt's route: its Tries, or the answer if it is refused."""
        if self.sessions is not None:
            self.sessions.resolve(request.info)  # its session, turn and pinned decode worker
        # Admission judges the route chosen (a prompt its decode worker prefills never waits in
        # the prefill pool's queues); the first attempt takes that route. No route: 503 below.
        decision = self.scheduler.schedule(request.info)
        rejection = self.scheduler.admit(request.info, decision) if decision is not None else None
        if rejection is not None:
            if (measured := http.get(MEASURED_KEY)) is not None:
                measured.decision = "rejected"
            self.metrics.rejections.labels("slo").inc()
            self.metrics.requests.labels("rejected", "rejected").inc()
            headers = {"Retry-After": str(int(rejection.retry_after_s))} if rejection.retry_after_s else None
            return error_response(rejection.status, rejection.message, headers=headers)
        force_local = None
        if request.fan_out:  # its samples would share one KV transfer (docs/router.md)
            if not (self.scheduler.local_prefill and self.config.failover.local_prefill_fallback):
                self.metrics.rejections.labels("bad_request").inc()
                why = ("this engine's decode cannot prefill a request itself"
                       if not self.scheduler.local_prefill else
                       "decode workers prefill nothing the policy does not send them "
                       "(failover.local_prefill_fallback is off)")
                return error_response(400, "parallel sampling (n above 1, beam search) is not "
                                           f"served disaggregated, and {why}: send n = 1", "n")
            force_local = "local prefill: parallel sampling (n > 1) shares no KV transfer"
        # A client's own X-Request-Id is kept for tracing, made unique so it cannot collide.
        client_id = request.client_id
        base_id = f"{self._id_prefix}-{next(self._ids)}" + (f"-{client_id[:64]}" if client_id else "")
        return Tries(self, request, path, decision, force_local, base_id)

    async def attempts(self, http: ClientHttp, tries: Tries, started: float) -> ClientOut:
        """Run attempts until one answers or the failover rules give up (failover.py)."""
        while True:
            attempt = tries.next_attempt()
            if not isinstance(attempt, Attempt):
                return attempt
            try:
                return await self._run(http, attempt, started, tries.history)
            except asyncio.CancelledError:
                # The client disconnected (aiohttp cancels the handler): _run closed the legs.
                self.client_left(attempt.decision, http.get(STAGE_KEY, "prefill"))
                raise
            except RequestRefused as refused:
                return self.refused(attempt, refused)
            except WorkerFailed as failed:
                if not tries.failed(failed):
                    return tries.given_up()

    def refused(self, attempt: Attempt, refused: RequestRefused) -> web.Response:
        """A worker's 4xx, passed to the client as it is (another worker would refuse it too)."""
        self.metrics.requests.labels(attempt.decision.label, "refused").inc()
        return web.Response(status=refused.status, body=refused.body,
                            headers={"Content-Type": refused.content_type or "application/json"})

    def fail(self, decision: str, status: int, message: str,
              history: Sequence[str]) -> web.Response:
        self.metrics.requests.labels(decision, "error").inc()
        if not history:
            return error_response(status, message)
        if self.config.route_header == "full":
            return error_response(status, f"{message}: " + "; ".join(history))
        # minimal: which legs failed, not where (worker addresses and their errors map the
        # deployment for anyone who can send a request); the detail is in the log
        log.warning("answered %d: %s: %s", status, message, "; ".join(history))
        legs = ", ".join(entry.split(" ", 1)[0] for entry in history)
        return error_response(status, f"{message} (failed legs: {legs}; details in the router's log)")

    # -- one attempt ------------------------------------------------------------------------
    async def _run(self, http: ClientHttp, attempt: Attempt, started: float,
                   history: Sequence[str]) -> ClientOut:
        decision, info = attempt.decision, attempt.request.info
        http[STAGE_KEY] = "prefill"
        measured = http.get(MEASURED_KEY)
        if measured is not None:  # the workers of the last attempt, even if it fails
            measured.prefill = decision.prefill.url if decision.prefill else None
            measured.decode = decision.decode.url
            measured.phase = "prefill"
        decode_body, prefill_task = await self._prepare(attempt)
        http[STAGE_KEY] = "decode"
        if measured is not None and decision.prefill is not None and prefill_task is None:
            measured.phase = "decode"  # its prompt prefilled (not so in push, nor a local prefill)
        charges = self.decode_starts(attempt, prefill_task is None)
        decision = attempt.decision
        decode_sent = False  # True once the decode leg's request is on its way

        def on_decode_sent() -> None:
            nonlocal decode_sent
            decode_sent = True

        # push and SGLang: the prefill leg runs alongside in its own task, and one that fails
        # before the decode's first byte (its whole answer, not streaming) stops the decode leg
        # here: it cancels this task, and its error is raised instead (a task and an
        # asyncio.wait per request for the decode leg cost measurable CPU).
        prefill_failed = first_done = False
        this_task = asyncio.current_task() if prefill_task is not None else None

        def on_prefill_done(task: asyncio.Task) -> None:
            nonlocal prefill_failed
            if not first_done and not task.cancelled() and task.exception() is not None:
                prefill_failed = True
                this_task.cancel()  # closes the decode leg: the engine aborts it

        if prefill_task is not None:
            prefill_task.add_done_callback(on_prefill_done)
        try:
            try:
                resp, payload = await self._decode_first(
                    attempt, decode_body, on_decode_sent if prefill_task is None else None)
                first_done = True
            except BaseException as exc:
                first_done = True
                if prefill_task is not None:
                    if (prefill_failed and isinstance(exc, asyncio.CancelledError)
                            and this_task.uncancel() == 0):  # only the prefill's cancel
                        failure = prefill_task.exception()
                        assert failure is not None  # (prefill_failed)
                        raise failure from None
                    prefill_task.cancel()  # the client left, or the decode failed
                    await asyncio.gather(prefill_task, return_exceptions=True)
                elif decision.prefill is not None:  # pull: the prefill holds the prompt's KV
                    if isinstance(exc, asyncio.CancelledError) and not decode_sent:
                        self.release_later(attempt, decode_body)
                    elif isinstance(exc, RequestRefused):  # the decode refused it unread
                        self.release_later(attempt, decode_body, "the decode refused the request")
                raise
            finally:
                charges.first_token()
            if prefill_task is not None:  # finishes on its own; nothing waits for it now
                prefill_task.add_done_callback(_consume)
            kv, header = self.decode_answered(attempt, history, charges, payload)
            http[STAGE_KEY] = "answer"
            if measured is not None:
                measured.decision, measured.decode = decision.label, decision.decode.url
                measured.phase = "answer"
            if not info.stream:
                self.finish(attempt, started, charges.started)
                if measured is not None:
                    measured.e2e_s, measured.answer = time.monotonic() - started, payload
                    measured.kv = kv
                return await self._send_whole(http, payload, {"Content-Type": "application/json",
                                                              "x-pd-route": header})
            return await self._relay_stream(http, attempt, resp, payload, header, started,
                                            charges.started)
        finally:
            charges.ended()

    def decode_starts(self, attempt: Attempt, prefilled_first: bool) -> DecodeCharges:
        """The decode leg is about to go out (its prompt prefilled first, unless push or SGLang
        prefill alongside): the policy's books charge it from now."""
        info = attempt.request.info
        if prefilled_first and info.expert_histogram is not None:
            # ELDR: the prefill reported the prompt's experts; the decode leg has not started
            attempt.decision = self.scheduler.rebind_decode(info, attempt.decision,
                                                            set(attempt.excluded_decode))
        decision = attempt.decision
        # the pull flow, streamed: decode leg sent -> first token, over the prompt tokens the
        # decode lacks (decode_first)
        pulled = (uncached_tokens(self.ctx, decision.decode, info)
                  if decision.prefill is not None and prefilled_first and info.stream else None)
        return DecodeCharges(self.ctx, decision, info, pulled)

    def decode_answered(self, attempt: Attempt, history: Sequence[str], charges: DecodeCharges,
                         payload: bytes) -> tuple[str | None, str]:
        """The decode's first byte (or whole answer) is in: its (KV verdict, route header)."""
        decision, info = attempt.decision, attempt.request.info
        if charges.pulled is not None:
            self.decode_first.observe(charges.pulled, time.monotonic() - charges.started)
        decision.decode.record_success()
        kv = None if info.stream else self._kv_verdict(payload, decision)
        return kv, self._route_header(decision, history, info, kv)

    async def _prepare(self, attempt: Attempt) -> tuple[LegBody, asyncio.Task | None]:
        """The flow's prepare (the pull prefill leg). A client that leaves while the prefill
        runs cancels this: the leg's connection closes, and the engine aborts it and frees its
        KV. One that leaves just as the prefill answers loses no answer: `_prefill_leg` returns
        it with `attempt.client_left` set, the KV it holds is released here, and the
        cancellation goes on. (No task of its own: one per request cost measurable CPU.)"""
        try:
            decode_body, prefill_task = await self.flow.prepare(attempt, self._prefill_leg)
        except WorkerFailed:
            if attempt.client_left:  # nobody to retry for
                raise asyncio.CancelledError from None
            raise
        if attempt.client_left:  # set only by a pull prefill leg, which ran in this task
            self.release_later(attempt, decode_body)
            raise asyncio.CancelledError
        return decode_body, prefill_task

    def release_later(self, attempt: Attempt, decode_body: LegBody,
                       why: str = "the client left") -> None:
        """The client left after the prefill answered but before the decode leg went out, or the
        decode refused the request (a 4xx: a check the prefill's one-token leg passed): the
        prefill holds the prompt's KV under its lease (vLLM: up to
        VLLM_NIXL_ABORT_REQUEST_TIMEOUT) for a read that will never come. A one-token decode leg
        reads it, which frees it on the prefill now; nobody waits for the answer. Its body is the
        one the prefill accepted (cut to one token, not streamed) with the prefill's params."""
        task = asyncio.create_task(self._release(attempt, one_token_body(leg_dict(decode_body)), why))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, attempt: Attempt, body: dict[str, Any], why: str) -> None:
        worker = attempt.decision.decode
        try:
            await whole_leg(self.pools, worker, "decode", attempt.path, body, attempt.request_id,
                            self.timeouts.decode_first_byte_s)
            log.info("request %s: %s after its prefill; the KV was released through decode %s",
                     attempt.request_id, why, worker.url)
        except Exception as exc:  # noqa: BLE001 - nobody awaits this task: log, never raise
            log.warning("request %s: %s after its prefill, and releasing its KV through decode %s "
                        "failed (the prefill's lease frees it): %s",
                        attempt.request_id, why, worker.url, exc)

    async def aclose(self) -> None:
        """Stop the KV releases still running (the pools close under them next)."""
        for task in list(self._releases):
            task.cancel()
        await asyncio.gather(*self._releases, return_exceptions=True)

    async def _prefill_leg(self, attempt: Attempt, body: LegBody) -> Any:
        """The prefill leg with its accounting; returns its answer's kv_transfer_params."""
        worker, info = attempt.decision.prefill, attempt.request.info
        assert worker is not None  # (a prefill leg goes to the decision's prefill worker)
        charge = accounting.prefill_started(self.ctx, worker, info)
        started = time.monotonic()
        orphans: list[bytes] = []

        def orphaned(status: int, payload: bytes) -> None:
            if status == 200:
                orphans.append(payload)

        try:
            payload = await whole_leg(self.pools, worker, "prefill", attempt.path, body,
                                      attempt.request_id, self.timeouts.prefill_s, on_orphan=orphaned)
        except asyncio.CancelledError:
            if not orphans:
                raise
            # The answer came in full just as the client left: the prefill holds its KV, which
            # _prepare releases before the cancellation goes on (or, for an answer that is not
            # one, just goes on with the cancellation).
            attempt.client_left = True
            payload = orphans[0]
        finally:
            accounting.prefill_ended(worker, info, charge)
        return self.prefill_answered(attempt, payload, charge, started)

    def prefill_answered(self, attempt: Attempt, payload: bytes, charge: Any, started: float) -> Any:
        """A prefill leg's 200 answer, in the books: its kv_transfer_params (WorkerFailed if it is
        not a JSON object)."""
        assert attempt.decision.prefill is not None
        params = answer_params(payload, attempt.decision.prefill, "prefill")
        self.prefill_booked(attempt, params, charge, time.monotonic() - started)
        return params

    def prefill_booked(self, attempt: Attempt, params: Any, charge: Any, elapsed: float) -> None:
        """What a prefill leg's answer (its kv_transfer_params) teaches the books: its latency,
        what the prefill now caches or pooled, the prompt's experts (ELDR)."""
        worker, info = attempt.decision.prefill, attempt.request.info
        assert worker is not None
        self.metrics.prefill_leg.observe(elapsed)
        try:
            section = pd_section_of(params)
        except ValueError as exc:  # the answer still serves; the router learns nothing from it
            log.warning("prefill %s sent an unusable pd section: %s", worker.url, exc)
            section = None
        stored = stored_tokens_of(params)  # PdLMCacheConnector: the prompt's tokens it pooled
        if stored and self.ctx.block_size:
            self.ctx.prefix_index.record_stored_in_pool(
                worker.url, info.block_keys[:stored // self.ctx.block_size])
        if self.scheduler.uses_expert_signatures and section is not None and section.experts:
            try:
                info.expert_histogram = ExpertSignature.decode(section.experts).histogram()
            except ValueError as exc:
                log.warning("prefill %s sent an unusable expert signature: %s", worker.url, exc)
        accounting.prefill_succeeded(self.ctx, worker, info, charge, elapsed,
                                     section.cached_tokens if section is not None else None,
                                     self.record_prefixes)

    async def _decode_first(self, attempt: Attempt, body: LegBody,
                            on_sent: Callable[[], None] | None = None):
        """Open the decode leg; return it with its first chunk (streaming) or whole body."""
        worker = attempt.decision.decode
        timeouts = self.timeouts
        if not attempt.request.info.stream:
            # an answer that is not streamed comes whole, headers and all, when its generation
            # ends: its first byte is its last, so the whole leg runs under decode_total_s
            payload = await whole_leg(self.pools, worker, "decode", attempt.path, body,
                                      attempt.request_id, timeouts.decode_total_s, None, on_sent)
            return None, json_answer(payload, worker)
        resp = await open_leg(self.pools, worker, "decode", attempt.path, body,
                              attempt.request_id, timeouts.decode_first_byte_s, on_sent)
        return resp, stream_begun(resp, worker)

    async def _relay_stream(self, http: ClientHttp, attempt: Attempt, resp: Response,
                            first_chunk: bytes, header: str, started: float,
                            decode_started: float) -> ClientOut:
        """The stream's pieces go to the client from the leg's connection callback (SseRelay);
        this task wakes when the relay needs it (a slow client, aiohttp's response) and at the
        end."""
        out, relay, deadline = self.relay_start(http, resp, first_chunk, header, decode_started)
        return await self.relay_rest(http, attempt, resp, out, relay, deadline, started,
                                      decode_started)

    def relay_start(self, http: Any, resp: Response, first_chunk: bytes, header: str,
                     decode_started: float) -> tuple[Any, SseRelay, float]:
        """The stream's head and first piece to the client, the rest piped to it: (the client's
        response, the relay, the decode's deadline)."""
        out = stream_response(http, SSE_HEAD % header.encode("latin-1", "replace")
                              if type(http) is FastRequest else {**SSE_HEADERS, "x-pd-route": header})
        relay = SseRelay(out, http.get(MEASURED_KEY), resp)
        deadline = decode_started + self.timeouts.decode_total_s
        relay(first_chunk)
        resp.pipe(relay, self.timeouts.decode_idle_s, deadline)
        return out, relay, deadline

    async def relay_rest(self, http: Any, attempt: Attempt, resp: Response, out: Any,
                          relay: SseRelay, deadline: float, started: float,
                          decode_started: float) -> ClientOut:
        """A piped stream until its end: what the relay holds written (a slow client), a failure
        mid-stream answered with an error event."""
        try:
            while True:
                if relay.held:
                    resp.disarm()  # the decode's timeouts do not run while the client is written to
                    waited = time.monotonic()
                    await self._write_held(http, out, relay)
                    # the time a slow client takes is not the decode's: its deadline moves by as much
                    deadline += time.monotonic() - waited
                    resp.resume(deadline)  # (also when done: a paused connection is not reused)
                if resp.done:
                    break
                await resp.piped()
            if relay.tail:  # the stream ended cleanly: its last bytes are the engine's to send
                await self._to_client(http, out, relay.tail)
        except ClientTooSlow:
            _measured_end(http, attempt.decision.label, 499)
            self._client_too_slow(http, attempt)
            return out  # releasing resp closes the leg and aborts the decode
        except UpstreamError as exc:
            message = ("stream stalled past the idle timeout" if isinstance(exc, UpstreamTimeout)
                       else str(exc))
            worker = attempt.decision.decode
            worker.record_failure(self.config.health.failure_threshold)
            log.warning("request %s: decode %s failed mid-stream: %s", attempt.request_id, worker.url, message)
            self.metrics.requests.labels(attempt.decision.label, "error").inc()
            _measured_end(http, "failed", 502)
            shown = f": {message}" if self.config.route_header == "full" else ""
            # the whole events that came before the failure, then an error event of its own
            await _write_quietly(out, b"".join(relay.pending) + b"data: " + error_body(
                502, f"decode worker failed mid-stream{shown}") + b"\n\n",
                                 self.timeouts.client_write_s)
            return out
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            # the client left; releasing resp closes the leg and aborts the decode
            _measured_end(http, attempt.decision.label, 499)
            self.client_left(attempt.decision, "answer")
            return out
        finally:
            resp.release()
        self.stream_done(http, attempt, relay, started, decode_started)
        await _write_quietly(out, None, self.timeouts.client_write_s)
        return out

    def stream_done(self, http: Any, attempt: Attempt, relay: SseRelay, started: float,
                    decode_started: float) -> None:
        """A stream relayed to its end: its timings measured, the request finished."""
        first_at, last_at = relay.first_at, relay.last_at
        tokens = max(1, relay.events - 1)  # the last event is [DONE]
        self.metrics.ttft.observe(first_at - started)
        if tokens > 1:
            tpot = (last_at - first_at) / (tokens - 1)
            self.metrics.tpot.observe(tpot)
            accounting.decode_observed(self.ctx, attempt.decision.decode, tpot)
        self.finish(attempt, started, decode_started)
        if (measured := http.get(MEASURED_KEY)) is not None:
            measured.ttft_s, measured.e2e_s = first_at - started, last_at - started
            measured.tpot_s = (last_at - first_at) / (tokens - 1) if tokens > 1 else None
            measured.output_tokens = tokens

    async def _write_held(self, http: ClientHttp, out: ClientOut, relay: SseRelay) -> None:
        """What the relay could not write: once the client's socket has drained, the events
        waiting (and those that come meanwhile, if the leg was not paused yet)."""
        if relay.gone:
            raise ConnectionResetError("the client closed the connection")
        if relay.fast:
            await self._to_client(http, out, b"")  # waits only while the socket is full
        while relay.pending:
            data = b"".join(relay.pending)
            relay.pending.clear()
            await self._to_client(http, out, data)
        relay.held = not relay.fast

    async def _to_client(self, http: ClientHttp, out: ClientOut, data: bytes,
                         eof: bool = False) -> None:
        """One write to the client under `timeouts.client_write_s` (ClientTooSlow past it)."""
        if isinstance(out, FastStreamResponse):  # the front server: only a full socket waits
            if out.send(data, eof):
                try:
                    async with asyncio.timeout(self.timeouts.client_write_s):
                        await out.drained()
                except TimeoutError:
                    raise ClientTooSlow from None
            return
        try:
            async with asyncio.timeout(self.timeouts.client_write_s):
                if not out.prepared:
                    await out.prepare(http)  # type: ignore[arg-type]  # (aiohttp's: its request)
                await out.write(data)
                if eof:
                    await out.write_eof()
        except TimeoutError:
            raise ClientTooSlow from None

    async def _send_whole(self, http: ClientHttp, payload: bytes,
                          headers: dict[str, str]) -> ClientOut:
        """A non-streaming answer, written under the client write timeout."""
        out = stream_response(http, headers)
        out.content_length = len(payload)
        try:
            await self._to_client(http, out, payload, eof=True)
        except ClientTooSlow:
            self._client_too_slow(http, None)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.metrics.client_gone.labels("answer", "disconnect").inc()
        return out

    async def drained(self, http: Any, drained: Callable[[], Awaitable[None]],
                      quietly: bool = False) -> None:
        """An answer's last bytes handed to a full socket (exchange.py; `drained()` waits for
        it): they drain within client_write_s, or the client is dropped as _send_whole drops it
        (`quietly`: as a stream's end, _write_quietly)."""
        try:
            async with asyncio.timeout(self.timeouts.client_write_s):
                await drained()
        except TimeoutError:
            if not quietly:
                self._client_too_slow(http, None)
        except ConnectionResetError:
            if not quietly:
                self.metrics.client_gone.labels("answer", "disconnect").inc()

    def _client_too_slow(self, http: ClientHttp, attempt: Attempt | None) -> None:
        """Drop a client that does not read its answer: the client's fault, not the worker's."""
        if attempt is not None:
            self.client_left(attempt.decision, "answer", "write_timeout")
        else:  # (its answer was whole, and counted)
            self.metrics.client_gone.labels("answer", "write_timeout").inc()
        log.warning("client %s did not read its answer within %g s: connection closed",
                    http.remote, self.timeouts.client_write_s)
        if http.transport is not None:
            http.transport.abort()

    def client_left(self, decision: Decision, stage: str, how: str = "disconnect") -> None:
        """A client that left (or was dropped) before its answer ended, counted at its stage."""
        self.metrics.client_gone.labels(stage, how).inc()
        self.metrics.requests.labels(decision.label, "client_gone").inc()

    def finish(self, attempt: Attempt, started: float, decode_started: float) -> None:
        now = time.monotonic()
        self.metrics.e2e.observe(now - started)
        self.metrics.decode_leg.observe(now - decode_started)
        self._ok[attempt.decision.label].inc()
        accounting.request_succeeded(self.ctx, attempt.decision.decode, attempt.request.info,
                                     self.record_prefixes)
        session_id = ""
        if self.sessions is not None:
            session_id = self.sessions.record(attempt.request.info, attempt.decision.decode.url)
        if self.sharing is not None:  # queued for the next batch: nothing waits on Redis
            prefill = attempt.decision.prefill
            self.sharing.served(session_id, attempt.request.info, attempt.decision.decode.url,
                                prefill.url if prefill is not None else None)

    def _kv_verdict(self, payload: bytes, decision: Decision | None = None) -> str | None:
        """The decode's `pd.kv` verdict word (counted; mismatches go to the quarantine's
        attribution), "other" if malformed, None if absent."""
        try:
            verdict = kv_verdict_in_answer(payload)
        except ValueError:
            word = "other"  # a peer's odd section: counted, never an error for the client
        else:
            if verdict is None:
                return None
            word = verdict.verdict
            if self.kv_quarantine is not None and decision is not None and verdict.mismatched > 0:
                self.kv_quarantine.verdict(decision.prefill, decision.decode, verdict.mismatched,
                                           self.ctx.pool)
        self.metrics.kv_verdicts.labels(word).inc()
        return word

    def _route_header(self, decision: Decision, history: Sequence[str], info: RequestInfo,
                      kv: str | None = None) -> str:
        """`route_header`: minimal tells a client only what happened to its request (no worker
        URLs, scores or session ids, which map the deployment for anyone who can send one)."""
        if self.config.route_header != "full":
            retried = f", retried={len(history)}" if history else ""
            return f"{self._model_tag}route={decision.label}{retried}"
        prefill = decision.prefill.url if decision.prefill else "local"
        session = (f", session={info.session_id}, turn={info.turn + 1}"
                   if info.session_id and self.sessions is not None else "")
        why = "; ".join(decision.reasons)
        retried = f"; retried after {len(history)} failure(s)" if history else ""
        verdict = f", kv={kv}" if kv is not None else ""
        return _ascii(f"{self._model_tag}prefill={prefill}, decode={decision.decode.url}{session}"
                      f"{verdict}, why={why}{retried}")


def _measured_end(http: ClientHttp, decision: str, status: int) -> None:
    """A request whose answer began but did not end well: what its record says."""
    if (measured := http.get(MEASURED_KEY)) is not None:
        measured.decision, measured.status = decision, status


def _ascii(text: str) -> str:
    return text.encode("ascii", "replace").decode().replace("\n", " ")[:1000]


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def _write_quietly(out: ClientOut, data: bytes | None, timeout_s: float) -> None:
    try:
        if isinstance(out, FastStreamResponse):  # the front server: only a full socket waits
            if out.send(data or b"", eof=True):
                async with asyncio.timeout(timeout_s):
                    await out.drained()
            return
        async with asyncio.timeout(timeout_s):
            if data is not None:
                await out.write(data)
            await out.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError, TimeoutError):
        pass
