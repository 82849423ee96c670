"""Background upkeep of the pool: active health checks and engine metrics scrapes.

Health: every `interval_s` each worker (every second, one that is down) gets GET /v1/models (which
also tells the router the served models and max_model_len) and, with `canary`, a one-token
generation (or the engine's own check: its profile's canary_path), because an engine can answer
/health while its scheduler is wedged. `failure_threshold` consecutive failures (probes or live
legs) take a worker out; `success_threshold` consecutive good probes bring it back. A worker that
has never answered a probe is out from the start.
Metrics: every `metrics_interval_s`, the engine's /metrics: queue length, running requests, KV usage
(the gauges its profile names), and a decode's KV mismatch counter, which can take it out of
rotation for a while (`kv_verify`, kv_quarantine.py). A worker whose count of injected KV faults
(a test setting, transfer/kv_faults.py) is above 0 gets a warning in the log, once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Iterable

import aiohttp
import msgspec

from pd_plugins.routers.config import RouterConfig
from pd_plugins.routers.flows import profile_for
from pd_plugins.routers.kv_quarantine import KvQuarantine
from pd_plugins.routers.workers import Worker
from pd_plugins.vocab.transfer_params import KV_FAULTS_INJECTED_METRIC, KV_MISMATCHED_REQUESTS_METRIC

log = logging.getLogger("pd_router.health")

# A worker's /metrics, /v1/models or canary answer (vLLM's are well under 1 MiB): no worker
# makes the router buffer more
MAX_PROBE_BYTES = 16 << 20
MAX_MODELS_PER_WORKER = 1024  # names (base model and adapters) kept from one /v1/models
ROUND_ERROR_LOG_S = 60.0  # a health round that keeps failing is logged once per this


async def read_capped(resp: aiohttp.ClientResponse, what: str) -> bytes:
    """A probe's or scrape's answer body, at most MAX_PROBE_BYTES (ValueError past it)."""
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > MAX_PROBE_BYTES:
            raise ValueError(f"{what} is larger than {MAX_PROBE_BYTES} bytes")
    return bytes(body)


def parse_engine_metrics(text: str, engine: str) -> tuple[float, float, float]:
    """Sum each gauge over its label sets (one per DP rank or model). A line that does not parse,
    or holds a value that is not a finite number >= 0, is skipped: an engine's odd line must not
    freeze or poison the load the policies see."""
    names = profile_for(engine).load_metrics
    totals = [0.0, 0.0, 0.0]
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        for i, name in enumerate(names):
            if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
                value = _sample_value(line[len(name):])
                if value is not None:
                    totals[i] += value
    if not all(math.isfinite(t) for t in totals):  # finite values whose sum is not
        raise ValueError("engine metrics sum past any finite load")
    waiting, running, usage = totals
    return waiting, running, min(1.0, usage)


def parse_counter(text: str, name: str) -> float | None:
    """A counter summed over its label sets; None if the engine exports no such counter."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            value = _sample_value(line[len(name):])
            if value is not None:
                total, seen = total + value, True
    return total if seen else None


def _sample_value(rest: str) -> float | None:
    """The value of `{labels} value [timestamp]` (or ` value [timestamp]`)."""
    if rest[0] == "{":
        end = rest.rfind("}")
        if end < 0:
            return None
        rest = rest[end + 1:]
    fields = rest.split()
    try:
        value = float(fields[0])
    except (ValueError, IndexError):
        return None
    return value if math.isfinite(value) and value >= 0 else None


class PoolUpkeep:
    """`pool`: the workers to keep, iterated afresh each round (a WorkerPool, or every model's
    workers together: server.py)."""

    def __init__(self, config: RouterConfig, pool: Iterable[Worker],
                 session: aiohttp.ClientSession) -> None:
        self.config, self.pool, self.session = config, pool, session
        self.spec = config.health
        self.profile = profile_for(config.engine)
        self._tasks: list[asyncio.Task] = []
        self.on_change = lambda: None  # called after each round of checks
        self._bad_metrics: set[str] = set()  # workers whose last scrape was unusable (logged once)
        self._injecting: set[str] = set()  # workers seen injecting KV faults (logged once)
        self.kv = KvQuarantine(self.spec.kv_verify) if self.spec.kv_verify is not None else None

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._health_loop()),
                       asyncio.create_task(self._metrics_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- health -------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        # Healthy workers every interval_s; workers that are down every tick, so they come back
        # quickly. Startup has just checked everyone once.
        # Nothing may end this loop either: a dead loop never probes a worker again (one that
        # went down stays out for good).
        tick = min(self.spec.interval_s, 1.0)
        loop = asyncio.get_running_loop()
        logged_at = -math.inf
        while True:
            await asyncio.sleep(tick)
            try:
                now = loop.time()
                due = [w for w in self.pool if not w.probing
                       and (not w.healthy or now - w.last_probe >= self.spec.interval_s)]
                if due:
                    await asyncio.gather(*(self.check(w) for w in due))
                    self.on_change()
            except Exception:  # noqa: BLE001 - logged (at most once a minute); the next round runs
                if loop.time() - logged_at >= ROUND_ERROR_LOG_S:
                    logged_at = loop.time()
                    log.exception("health check round failed (health checks go on; further "
                                  "failures logged at most every %.0f s)", ROUND_ERROR_LOG_S)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.pool))

    async def check(self, worker: Worker) -> bool:
        worker.last_probe = asyncio.get_running_loop().time()
        worker.probing = True
        try:  # not wait_for: on Python 3.11 it can swallow the cancel that stops the health loop
            async with asyncio.timeout(self.spec.timeout_s):
                await self._probe(worker)
        except Exception as exc:  # noqa: BLE001 - any failure of the probe counts against the worker
            reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
            if not worker.ever_up:  # never seen working: not routable until a probe succeeds
                worker.healthy = False
            if worker.record_failure(self.spec.failure_threshold) or not worker.ever_up:
                log.warning("worker %s down: health probe %s", worker.url, reason)
            return False
        finally:
            worker.probing = False
        first_up = not worker.ever_up
        worker.ever_up = True
        worker.consecutive_failures = 0
        worker.consecutive_successes += 1
        if not worker.healthy and self.kv is not None and self.kv.quarantined(worker):
            return True  # KV mismatches: out until quarantine_s has passed, whatever probes say
        # A new worker is in at its first passing probe; one that went down needs success_threshold.
        if not worker.healthy and (first_up or
                                   worker.consecutive_successes >= self.spec.success_threshold):
            worker.healthy = True
            log.info("worker %s %s", worker.url, "up" if first_up else "back up")
        return True

    async def _probe(self, worker: Worker) -> None:
        async with self.session.get(worker.url + "/v1/models") as resp:
            resp.raise_for_status()
            listing = msgspec.json.decode(await read_capped(resp, "/v1/models"))
        models = [m for m in listing.get("data", []) if isinstance(m, dict)
                  and isinstance(m.get("id"), str)][:MAX_MODELS_PER_WORKER]
        worker.models = tuple(m["id"] for m in models)
        if worker.model and worker.model not in worker.models:
            # requests for this model would reach an engine serving another (its 404s, or worse,
            # another model's answers): a worker is up only once it serves its model
            raise ValueError(f"it serves {', '.join(worker.models[:3]) or 'no model'}, not "
                             f"{worker.model!r}")
        # vLLM lists each LoRA adapter with its base model as `parent` (the base: parent null)
        worker.adapter_parents = {m["id"]: m["parent"] for m in models
                                  if isinstance(m.get("parent"), str) and m["parent"] != m["id"]}
        lengths = [m["max_model_len"] for m in models if isinstance(m.get("max_model_len"), int)]
        worker.max_model_len = min(lengths) if lengths else None
        if not self.spec.canary:
            return
        if self.profile.canary_path is not None:  # the engine's own generation check
            async with self.session.get(worker.url + self.profile.canary_path) as resp:
                resp.raise_for_status()
            return
        body = {"prompt": [1], "max_tokens": 1, "temperature": 0}
        if worker.models:
            body["model"] = worker.models[0]
        async with self.session.post(worker.url + "/v1/completions", json=body,
                                     headers={"X-Request-Id": f"pd-router-canary-{worker.ordinal}"}) as resp:
            resp.raise_for_status()
            answer = msgspec.json.decode(await read_capped(resp, "the canary's answer"))
        if not answer.get("choices"):
            raise ValueError("canary generation returned no choices")

    # -- engine metrics --------------------------------------------------------------------
    async def _metrics_loop(self) -> None:
        # Nothing a worker answers may end this loop: a dead loop freezes every worker's load.
        while True:
            try:
                await asyncio.gather(*(self.scrape(w) for w in self.pool if w.healthy),
                                     return_exceptions=True)
                # What is logged once per worker is forgotten with the worker (churn stays bounded).
                live = {w.url for w in self.pool}
                self._bad_metrics &= live
                self._injecting &= live
            except Exception:  # noqa: BLE001 - logged; the next round runs regardless
                log.exception("engine metrics round failed")
            await asyncio.sleep(self.spec.metrics_interval_s)

    async def scrape(self, worker: Worker) -> None:
        """One worker's load from its /metrics; any failure leaves the last values in place."""
        try:
            async with self.session.get(worker.url + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=self.spec.timeout_s)) as resp:
                if resp.status != 200:
                    return
                body = await read_capped(resp, "/metrics")
            text = body.decode("utf-8", "replace")
            load = parse_engine_metrics(text, self.profile.name)
            mismatched = (parse_counter(text, KV_MISMATCHED_REQUESTS_METRIC)
                          if self.kv is not None and worker.role == "decode" else None)
            injected = parse_counter(text, KV_FAULTS_INJECTED_METRIC)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return
        except Exception as exc:  # noqa: BLE001 - whatever the engine sent, scraping goes on
            if worker.url not in self._bad_metrics:
                self._bad_metrics.add(worker.url)
                log.warning("worker %s: unusable /metrics answer (%s: %s); its load stays as last "
                            "scraped", worker.url, type(exc).__name__, exc)
            return
        self._bad_metrics.discard(worker.url)
        worker.engine_waiting, worker.engine_running, worker.kv_usage = load
        worker.last_scrape = asyncio.get_running_loop().time()
        if injected and worker.url not in self._injecting:
            self._injecting.add(worker.url)
            log.warning("worker %s has injected %d KV faults: it runs with fault injection on "
                        "(PD_KV_FAULTS / the `faults` option, for tests only; engines refuse it "
                        "under PD_PRODUCTION=1)", worker.url, int(injected))
        if mismatched is not None and self.kv.observe(worker, mismatched, self.pool):
            self.on_change()
