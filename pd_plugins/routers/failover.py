"""The attempts of one request: which (prefill, decode) pair comes next after a failed leg, and
when to give up.

Rules: a failed prefill leg is retried on another prefill worker (`prefill_retries`), then the
decode worker prefills locally if `local_prefill_fallback`; a decode failure before the first byte
reaches the client is retried (`decode_retries`) on another decode worker, or on the same one when
it is the only one left, always with a fresh prefill (the old one's KV may be gone). After
streaming has begun there is no retry: the stream ends with an error event (proxy.py).

One `Tries` per request, kept by whoever runs its attempts: the proxy's coroutine
(`Proxy.attempts`) or the callbacks that serve the first attempt (exchange.py), which hand it
over to the coroutine when an attempt fails.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from pd_plugins.routers.flows.base import Attempt
from pd_plugins.routers.policy import Decision
from pd_plugins.routers.request import ClientRequest
from pd_plugins.routers.upstream import WorkerFailed

log = logging.getLogger("pd_router.proxy")


_NONE: frozenset = frozenset()


class Tries:
    # What only a failure changes stays a class default until one does (most requests have
    # none): the workers each leg failed on (set in __init__: mypyc takes no frozenset default),
    # the retries left, and "leg url: what failed" per failed attempt.
    excluded_prefill: frozenset | set
    excluded_decode: frozenset | set
    prefill_left: int | None = None
    decode_left: int | None = None
    history: tuple | list = ()
    number = 0  # attempts made

    def __init__(self, proxy: Any, request: ClientRequest, path: str, decision: Decision | None,
                 force_local: str | None, base_id: str) -> None:
        self.proxy, self.request, self.path = proxy, request, path
        self.decision: Decision | None = decision  # the first attempt's: the one admission judged
        self.force_local = force_local  # why every attempt prefills on its decode worker
        self.base_id = base_id  # each attempt's request id is this and its number
        self.excluded_prefill = self.excluded_decode = _NONE

    def next_attempt(self) -> Attempt | web.Response:
        """The next attempt, or the answer that there is none."""
        proxy, info = self.proxy, self.request.info
        scheduler, failover = proxy.scheduler, proxy.config.failover
        decision = self.decision
        if self.number:
            if self.number >= 2 + failover.prefill_retries + failover.decode_retries:
                return self.given_up()
            decision = scheduler.schedule(info, self.excluded_prefill, self.excluded_decode)
        if decision is None:
            if not scheduler.local_prefill and proxy.ctx.pool.usable("decode"):
                return proxy.fail("none", 503, "no usable prefill worker (an SGLang decode "
                                   "cannot prefill a request itself)", self.history)
            return self.given_up()
        if self.force_local is not None and decision.prefill is not None:
            decision = Decision(decision.decode, None, decision.reasons[:1] + [self.force_local])
        elif (decision.prefill is None and not failover.local_prefill_fallback
              and proxy.ctx.pool.by_role("prefill") and "no usable prefill" in decision.reasons[-1]):
            return proxy.fail("none", 503, "no usable prefill worker", self.history)
        attempt = Attempt(self.request, decision, f"{self.base_id}-{self.number}", self.path,
                          frozenset(self.excluded_decode))
        self.number += 1
        return attempt

    def failed(self, failed: WorkerFailed) -> bool:
        """Count a failed attempt against its worker; whether to try again."""
        proxy, failover = self.proxy, self.proxy.config.failover
        if self.prefill_left is None:  # the first failure: the tables of its own
            self.prefill_left, self.decode_left = failover.prefill_retries, failover.decode_retries
            self.excluded_prefill, self.excluded_decode, self.history = set(), set(), []
        self.history.append(f"{failed.leg} {failed.worker.url}: {failed.message}")
        if failed.worker.record_failure(proxy.config.health.failure_threshold):
            log.warning("worker %s marked unhealthy after %d failures", failed.worker.url,
                        failed.worker.consecutive_failures)
        log.warning("request %s: %s", self.base_id, self.history[-1])
        if failed.leg == "prefill":
            self.excluded_prefill.add(failed.worker)
            self.prefill_left -= 1
            if self.prefill_left < 0:
                if not (failover.local_prefill_fallback and proxy.scheduler.local_prefill):
                    return False
                self.force_local = "local prefill: prefill workers failed"
            proxy.metrics.retries.labels("prefill").inc()
            return True
        # Another decode worker if there is one; else the same one again (with a fresh prefill),
        # as a transient stall is more likely than a dead worker that still passes its checks.
        others = [w for w in proxy.ctx.pool.usable("decode")
                  if w is not failed.worker and w not in self.excluded_decode]
        if others:
            self.excluded_decode.add(failed.worker)
        self.decode_left -= 1  # type: ignore[operator]  # (set with prefill_left, above)
        if self.decode_left < 0:
            return False
        proxy.metrics.retries.labels("decode").inc()
        return True

    def given_up(self) -> web.Response:
        if not self.history:
            return self.proxy.fail("none", 503, "no healthy decode worker", self.history)
        return self.proxy.fail("failed", 502, "the request failed on every worker tried",
                                self.history)
