"""A front-server request on a flow whose legs follow one another (vLLM pull, the pools) or go
out together (SGLang, vLLM push), served from the connections' callbacks: no task, coroutine or
future per request.

Why: a task, a chain of coroutines and a future per leg cost about as much CPU per request as
the router's own work (issue 30; docs/benchmarks.md, "The I/O framework against the work").

The front connection hands the parsed request to Proxy.serve, which makes an Exchange. It sends
the prefill leg (http_client.Leg); the leg's connection calls it back with the answer; it sends
the decode leg with the prefill's kv_transfer_params; the decode's connection calls it back with
the whole answer, written to the client at once, or with the stream's first piece: the head
goes out and the rest is relayed from the decode's connection (stream_relay.SseRelay) to its
end. On a flow whose legs go out together (`alongside`: SGLang's bootstrap; vLLM push, whose
prefill leg waits out a head start on a timer after the decode's) both are sent, as the
coroutine path's prefill task and decode leg: a prefill that fails before the
decode's first byte fails the attempt (the decode leg is closed), a decode that fails closes a
prefill still running, and one still running at the decode's first byte finishes on its own
(its callback keeps the books). The request's accounting, metrics and route header are the
proxy's own methods, as in its coroutine path.

Whatever must wait on something else goes on in the request's task, in the proxy's code, from
where the exchange stands:
- a failed leg: the next attempt (failover.py) in Proxy.attempts;
- a client whose socket is full: the answer's end drains in a task (Proxy.drained), a stream's
  relay goes on in Proxy.relay_rest (which also ends a stream whose decode failed mid-way with
  an error event).
A client that leaves closes the open legs (the engine aborts them), or, on vLLM's pull flow, when
the prefill has answered and the decode leg is not yet out, sends the one-token leg that
releases the prefill's KV (Proxy.release_later).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Coroutine

from pd_plugins.routers import accounting
from pd_plugins.routers.failover import Tries
from pd_plugins.routers.flows import Attempt
from pd_plugins.routers.http_client import Leg, Response
from pd_plugins.routers.http_server import CallbackAnswer, FastRequest, answered
from pd_plugins.routers.request import ClientRequest, LegBody
from pd_plugins.routers.upstream import (RequestRefused, WorkerFailed, answer_params, json_answer,
                                        leg_answer, opened_answer, send_leg, stream_begun)


log = logging.getLogger("pd_router.exchange")

# a whole answer's headers (http_server.header_lines of Content-Type and the route header)
JSON_HEAD = b"Content-Type: application/json\r\nx-pd-route: %b\r\n"


class Exchange(CallbackAnswer):
    # (no __slots__: what a request sets only at some stage is a class default until then)
    stage = "prefill"  # then decode, then answer (client_gone's label)
    leg: Leg | None = None  # the leg in flight
    alongside: Leg | None = None  # a prefill leg sent with the decode's (flow.alongside)
    prefill_charge: Any = None
    prefill_started = 0.0
    decode_body: LegBody | None = None
    charges: accounting.DecodeCharges | None = None
    stream: Response | None = None  # a streamed answer being relayed: its response, relay, the
    out: Any = None  # client's response and the decode's deadline (Proxy.relay_start)
    relay: Any = None
    deadline = 0.0
    in_task = False  # what must wait runs in the request's task (_hand_over), and has begun
    prefill_due: asyncio.TimerHandle | None = None  # a prefill leg waiting out its head start

    @classmethod
    def begin(cls, proxy: Any, http: FastRequest, request: ClientRequest, path: str) -> Any:
        """The request's Exchange, its first leg sent; or its answer made already (refused by
        admission, no route), awaitable."""
        started = time.monotonic()
        tries = proxy.begin(http, request, path)
        if not isinstance(tries, Tries):
            return answered(tries)
        attempt = tries.next_attempt()
        if not isinstance(attempt, Attempt):
            return answered(attempt)
        exchange = cls(proxy, http, tries, attempt, started)
        try:
            exchange._start()
        except Exception:  # noqa: BLE001 - a bug: what went out is closed and out of the books
            exchange._failed_on_bug()
        return exchange

    def __init__(self, proxy: Any, http: FastRequest, tries: Tries, attempt: Attempt,
                 started: float) -> None:
        super().__init__(http.conn)  # the connection's request is this exchange's from now on
        self.proxy, self.http, self.tries, self.attempt = proxy, http, tries, attempt
        self.started = started

    # -- the legs ----------------------------------------------------------------------------
    def _start(self) -> None:
        attempt = self.attempt
        if attempt.decision.prefill is None:  # its decode worker prefills it
            self._send_decode(attempt.request.body_with())
            return
        flow = self.proxy.flow
        if flow.sequential:
            self.leg = self._send_prefill(flow.prefill_body(attempt.request.body), self._prefilled)
            return
        prefill_body, self.decode_body = flow.bodies(attempt)
        if not flow.decode_first:  # SGLang
            self.alongside = self._send_prefill(prefill_body, self._prefilled_alongside)
            self._send_decode(self.decode_body, prefilled_first=False)
            return
        # vLLM push: the decode registers the blocks the prefill writes into first
        self._send_decode(self.decode_body, prefilled_first=False)
        if flow.head_start_s > 0:
            self.prefill_due = asyncio.get_running_loop().call_later(
                flow.head_start_s, self._send_alongside, prefill_body)
        else:
            self.alongside = self._send_prefill(prefill_body, self._prefilled_alongside)

    def _send_prefill(self, body: LegBody, answered_to: Callable[[Leg], None]) -> Leg:
        """The prefill leg sent, in the books."""
        proxy, attempt = self.proxy, self.attempt
        prefill = attempt.decision.prefill
        assert prefill is not None  # (a prefill leg goes to the decision's prefill worker)
        self.prefill_charge = accounting.prefill_started(proxy.ctx, prefill, attempt.request.info)
        self.prefill_started = time.monotonic()
        try:
            return send_leg(proxy.pools, prefill, attempt.path, body, attempt.request_id,
                            proxy.timeouts.prefill_s, answered_to)
        except BaseException:
            self._prefill_ended()
            raise

    def _send_alongside(self, body: LegBody) -> None:
        """A head start over: the prefill leg goes out beside the decode's (which may have
        answered meanwhile: then it runs on its own, as on the coroutine path)."""
        self.prefill_due = None
        try:
            self.alongside = self._send_prefill(body, self._prefilled_alongside)
        except Exception:  # noqa: BLE001 - a bug: answered 500, never a connection left hanging
            if self.stage == "decode" and self.leg is not None:  # (the request is still ours)
                self._failed_on_bug()
            else:
                log.exception("sending a prefill leg failed the router")

    def _prefilled(self, leg: Leg) -> None:
        """The prefill answered: the decode leg is sent with its kv_transfer_params, and only
        then does the answer go into the books (they are not the request's latency), unless the
        decode leg depends on them: its worker chosen by the prompt's experts (ELDR), or, streamed,
        its charge by the prompt tokens its worker lacks (what the prefill pooled counts)."""
        self.leg = None
        proxy, attempt = self.proxy, self.attempt
        elapsed = time.monotonic() - self.prefill_started
        books_first = proxy.scheduler.uses_expert_signatures or attempt.request.info.stream
        try:
            params = self._prefill_params(leg)
            try:
                self.decode_body = proxy.flow.decode_body(attempt, params)
            except WorkerFailed:  # an answer with no usable params: booked, as the proxy books it
                proxy.prefill_booked(attempt, params, self.prefill_charge, elapsed)
                raise
            if books_first:
                proxy.prefill_booked(attempt, params, self.prefill_charge, elapsed)
            self._send_decode(self.decode_body)
        except (RequestRefused, WorkerFailed) as exc:
            self._leg_failed(exc)
            return
        except Exception:  # noqa: BLE001 - a bug: answered 500, never a connection left hanging
            self._failed_on_bug()
            return
        if not books_first:
            try:
                proxy.prefill_booked(attempt, params, self.prefill_charge, elapsed)
            except Exception:  # noqa: BLE001 - a bug: logged; the decode leg is out already
                log.exception("booking a prefill's answer failed the router")

    def _prefilled_alongside(self, leg: Leg) -> None:
        """The prefill leg sent with the decode's answered or failed: in the books; a failure
        before the decode's first byte fails the attempt (after it, the answer stands)."""
        self.alongside = None
        elapsed = time.monotonic() - self.prefill_started
        try:
            params = self._prefill_params(leg)
            self.proxy.prefill_booked(self.attempt, params, self.prefill_charge, elapsed)
        except (RequestRefused, WorkerFailed) as exc:
            if self.stage == "decode" and self.leg is not None:
                decode, self.leg = self.leg, None
                decode.cancel()  # its connection closes: the engine aborts it
                self.charges.ended()
                self._leg_failed(exc)
        except Exception:  # noqa: BLE001 - a bug: answered 500, never a connection left hanging
            if self.stage == "decode" and self.leg is not None:  # (the request is still ours)
                self._failed_on_bug()
            else:  # the answer is under way or over: only the books were left
                log.exception("a prefill leg's answer failed the router")

    def _prefill_params(self, leg: Leg) -> Any:
        """A prefill leg's answer, its charge ended: its kv_transfer_params (RequestRefused,
        WorkerFailed as leg_answer and answer_params raise them). What it teaches goes into the
        books apart (Proxy.prefill_booked), when the caller says."""
        prefill = self.attempt.decision.prefill
        try:
            payload = leg_answer(leg, prefill, "prefill")
        finally:
            self._prefill_ended()
        return answer_params(payload, prefill, "prefill")

    def _prefill_ended(self) -> None:
        """The prefill leg's charge out of the books (once per leg: its callers see to it)."""
        attempt, prefill = self.attempt, self.attempt.decision.prefill
        assert prefill is not None  # (a prefill leg went out)
        accounting.prefill_ended(prefill, attempt.request.info, self.prefill_charge)

    def _send_decode(self, body: LegBody, prefilled_first: bool = True) -> None:
        proxy, attempt = self.proxy, self.attempt
        self.stage = "decode"
        self.charges = proxy.decode_starts(attempt, prefilled_first)
        stream, timeouts = attempt.request.info.stream, proxy.timeouts
        # a whole answer's first byte is its last: the leg runs under decode_total_s
        self.leg = send_leg(proxy.pools, attempt.decision.decode, attempt.path, body,
                            attempt.request_id,
                            timeouts.decode_first_byte_s if stream else timeouts.decode_total_s,
                            self._decoded, opened=stream)

    def _decoded(self, leg: Leg) -> None:
        self.leg = None
        try:
            last = self._answer(leg)
        except Exception:  # noqa: BLE001 - a bug: answered 500, never a connection left hanging
            self._failed_on_bug()
            return
        if last is not None:  # (outside the guard: answer_ended() may start the next request)
            self._send_last(*last)

    def _answer(self, leg: Leg) -> tuple | None:
        """The decode's answer: written whole (returned: what _send_last writes), or the
        stream's relay begun, or the attempt failed."""
        proxy, attempt, charges = self.proxy, self.attempt, self.charges
        decode, info = attempt.decision.decode, attempt.request.info
        try:
            try:
                if info.stream:
                    self.stream = opened_answer(leg, decode, "decode")  # (ours to release)
                    payload = stream_begun(self.stream, decode)
                else:
                    payload = json_answer(leg_answer(leg, decode, "decode"), decode)
            finally:
                charges.first_token()
        except (RequestRefused, WorkerFailed) as exc:
            self.stream = None  # (stream_begun released it)
            charges.ended()
            self._close_alongside()  # a prefill still running: nobody waits for it now
            if (isinstance(exc, RequestRefused) and attempt.decision.prefill is not None
                    and proxy.flow.sequential):
                # the decode refused it unread: the prefill still holds the prompt's KV
                proxy.release_later(attempt, self.decode_body, "the decode refused the request")
            self._leg_failed(exc)
            return None
        header = proxy.decode_answered(attempt, self.tries.history, charges, payload)[1]
        self.stage = "answer"
        if not info.stream:
            conn = self.http.conn
            headers = JSON_HEAD % header.encode("latin-1", "replace")
            return conn.drain, lambda: conn.send_whole(200, headers, payload), False, self._finished
        resp = self.stream
        self.out, self.relay, self.deadline = proxy.relay_start(self.http, resp, payload, header,
                                                                charges.started)
        resp.notify(self._streamed)
        return self._stream_progress()  # (the first pieces may have ended it, or filled the socket)

    def _streamed(self) -> None:
        """The relayed stream ended, paused (the client's socket is full) or failed."""
        try:
            last = self._stream_progress()
        except Exception:  # noqa: BLE001 - a bug: the connection is closed, never left hanging
            self._failed_on_bug()
            return
        if last is not None:
            self._send_last(*last)

    def _stream_progress(self) -> tuple | None:
        resp, relay, out = self.stream, self.relay, self.out
        if resp.done and not (relay.held or relay.tail):
            self.stream = None
            resp.release()
            return out.drained, lambda: out.send(b"", eof=True), True, self._stream_finished
        if resp.done or resp.paused or relay.held or resp.exception is not None:
            resp.notify(None)  # the task waits on it from now on
            self._hand_over(self.proxy.relay_rest(self.http, self.attempt, resp, out, relay,
                                                  self.deadline, self.started,
                                                  self.charges.started))
        return None

    # -- endings -----------------------------------------------------------------------------
    def _finished(self) -> None:
        """A whole answer on its way: the request out of the books."""
        try:
            self.proxy.finish(self.attempt, self.started, self.charges.started)
        finally:
            self.charges.ended()

    def _stream_finished(self) -> None:
        """A relayed stream's end on its way: its timings measured, the request out of the books."""
        try:
            self.proxy.stream_done(self.http, self.attempt, self.relay, self.started,
                                   self.charges.started)
        finally:
            self.charges.ended()

    def _send_last(self, drained: Callable[[], Awaitable[None]], send: Callable[[], bool],
                   quietly: bool, books: Callable[[], None]) -> None:
        """The answer's last bytes (`send()`, True if the socket is full), then the request's
        `books` (after: they are not its latency): the connection reads on, or the bytes drain
        in a task first (`drained()`; `quietly`: a stream's end, as Proxy.relay_rest ends one)."""
        try:
            full: bool | None = send()
        except ConnectionResetError:  # the client is leaving: its connection_lost follows
            full = None
        except Exception:  # noqa: BLE001 - a bug: the books close all the same, the client drops
            _close_books(books)
            self._failed_on_bug()
            return
        _close_books(books)
        if full is None:
            if not quietly:
                self.proxy.metrics.client_gone.labels("answer", "disconnect").inc()
            self.http.conn.drop()
            return
        if full:
            self._hand_over(self.proxy.drained(self.http, drained, quietly))
        else:
            self.http.conn.answer_ended()

    def _leg_failed(self, exc: RequestRefused | WorkerFailed) -> None:
        proxy, conn = self.proxy, self.http.conn
        if isinstance(exc, RequestRefused):
            conn.respond(proxy.refused(self.attempt, exc), self.http)
        elif self.tries.failed(exc):  # the next attempt, in a task (failover is rare)
            self.stage = "prefill"  # (what a client that leaves before it begins is counted at)
            self._hand_over(proxy.attempts(self.http, self.tries, self.started),
                            counts_itself=True)
        else:
            conn.respond(self.tries.given_up(), self.http)

    def _hand_over(self, rest: Coroutine, counts_itself: bool = False) -> None:
        """The rest of the request in its task (`rest`; `counts_itself`: it counts a client
        that leaves, as Proxy.attempts does). What the exchange still holds is released when the
        task ends, however it ends, even cancelled before it began (the client left first)."""
        inner = self._in_task(rest, counts_itself)
        task = self.http.conn.run(inner, self.http)
        task.add_done_callback(lambda task: self._task_ended(inner, rest))

    async def _in_task(self, rest: Coroutine, counts_itself: bool) -> Any:
        self.in_task = True
        try:
            return await rest
        except asyncio.CancelledError:  # the client left while the task waited
            if not counts_itself:
                self.proxy.client_left(self.attempt.decision, self.stage)
            raise
        finally:
            self._close_legs()

    def _task_ended(self, inner: Coroutine, rest: Coroutine) -> None:
        if not self.in_task:  # cancelled before its first step: the client left meanwhile
            inner.close()  # (neither ever ran)
            rest.close()
            self._close_legs()
            self.proxy.client_left(self.attempt.decision, self.stage)

    def _close_legs(self) -> None:
        """Close what this request holds: the leg in flight, a stream, the books' charges
        (each once: a second call finds nothing)."""
        attempt = self.attempt
        if self.stage != "answer":  # (after the decode's first byte it finishes on its own)
            self._close_alongside()
        leg, self.leg = self.leg, None
        if leg is not None:
            leg.cancel()  # its connection closes: the engine aborts the request
            if self.stage == "prefill":
                self._prefill_ended()
            elif not leg.sent and attempt.decision.prefill is not None and self.proxy.flow.sequential:
                # the prefill answered, the decode leg never went out: its KV is released
                self.proxy.release_later(attempt, self.decode_body)
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.release()  # not at its end: closed, and the decode aborts
        if self.charges is not None:
            self.charges.ended()

    def _close_alongside(self) -> None:
        """A prefill leg sent with the decode's and still running: closed, out of the books (or
        one still waiting out its head start: never sent)."""
        due, self.prefill_due = self.prefill_due, None
        if due is not None:
            due.cancel()
        leg, self.alongside = self.alongside, None
        if leg is not None:
            leg.cancel()
            self._prefill_ended()

    def client_gone(self) -> None:
        self._close_legs()
        self.proxy.client_left(self.attempt.decision, self.stage)

    def _failed_on_bug(self) -> None:
        try:
            self._close_legs()
        finally:
            self.http.conn.answer_failed(self.http)


def _close_books(books: Callable[[], None]) -> None:
    """A request's books closed once its answer is out (Exchange._send_last)."""
    try:
        books()
    except Exception:  # noqa: BLE001 - a bug: the answer is out; the connection serves on
        log.exception("closing a request's books failed")
