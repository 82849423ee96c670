"""Open-loop replay of a workload over HTTP, through a router, against a cluster on an accelerated
clock (`pd-mock-engine --latency-model PRESET --speedup X`, or real engines with speedup 1).

Request i is sent `arrival_s / speedup` wall seconds after the start, whatever became of the
earlier ones (open loop), as a streaming /v1/completions of its token ids (`prompt_token_ids`) with
`max_tokens` = its output tokens and `ignore_eos`. Times are measured at the client and reported in
MODEL seconds (wall x speedup), so they compare with the simulator's (cluster_sim.py) and with
report.summarize's SLOs. At a high speedup every wall millisecond of HTTP and scheduling overhead
counts `speedup` model milliseconds: pick the speedup so that those stay small next to the step
times (the mocks' `/mock/stats` `max_lag_s` says when they fell behind the model).

    result = asyncio.run(replay(router_url, reqs, speedup=20, model="mock", timeout_s=60))
    stats = asyncio.run(collect_engine_stats(engine_urls))   # pd_plugins.mock.client
    print(report.summarize(result.outcomes, slo, result.span_s, itl_s=result.itl_s,
                           cached_tokens=stats["cached_tokens"], computed_tokens=stats["computed_tokens"],
                           kv_bytes_moved=stats["kv_bytes_moved"]))
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Sequence

import aiohttp
import msgspec

from pd_plugins.perf.cluster_sim import RequestOutcome
from pd_plugins.workloads import TraceRequest, prompt_token_ids


@dataclass(slots=True)
class ReplayOutcome(RequestOutcome):
    """A RequestOutcome (the fields report.summarize reads) measured over HTTP, in model seconds
    from the moment the request was sent."""

    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive streamed tokens
    tokens: int = 0                   # content chunks received
    route: str | None = None          # the router's x-pd-route header
    error: str | None = None          # why it was rejected or failed
    send_lag_s: float = 0.0           # how late (model s) the client sent it after its arrival
    # The model time its legs spent in the engines before their first tokens (modelled mocks'
    # /mock/timings, mock/client.py attach_engine_times): ttft_s minus this is what HTTP and
    # the router cost.
    engine_ttft_s: float | None = None


@dataclass
class ReplayResult:
    outcomes: list[ReplayOutcome]
    span_s: float                     # model seconds from the start to the last answer
    wall_s: float
    speedup: float

    @property
    def itl_s(self) -> list[float]:
        """Every inter-token gap of every served request (report.summarize's `itl_s`)."""
        return [gap for o in self.outcomes if o.status == "ok" for gap in o.itl_s]


def next_turn_outputs(requests: Sequence[TraceRequest]) -> dict[int, list[int]]:
    """For a turn followed by another of its session: the tokens its answer adds to the
    conversation, as the next turn's prompt holds them."""
    out, last = {}, {}
    for r in requests:
        prev = last.get(r.session_id) if r.session_id is not None else None
        if prev is not None:
            ids = prompt_token_ids(r)
            out[prev.request_id] = ids[prev.input_tokens:prev.input_tokens + prev.output_tokens]
        if r.session_id is not None:
            last[r.session_id] = r
    return out


def request_body(r: TraceRequest, model: str, mock_outputs: dict[int, list[int]] | bool = False) -> dict:
    body = {"model": model, "prompt": prompt_token_ids(r), "max_tokens": r.output_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    if mock_outputs and r.request_id in mock_outputs:
        # A named fake's extension (pd_plugins.mock.protocol): a real engine's answer is what the
        # next turn resends; a modelled mock is told those tokens so that it caches the blocks
        # they complete.
        body["mock_output_ids"] = mock_outputs[r.request_id]
    return body


async def replay(url: str | Sequence[str], requests: Sequence[TraceRequest], speedup: float, model: str,
                 timeout_s: float, progress: Callable[[int], None] | None = None,
                 max_connections: int = 10_000, mock_outputs: bool = False) -> ReplayResult:
    """Send `requests` open loop to `url` (a router or an engine; several URLs: a round-robin
    load balancer in front of them, request i to url[i % len(url)]); `timeout_s` bounds each
    request in WALL seconds (past it the request counts as failed). `mock_outputs`: tell
    latency-modelled mocks which tokens each turn "generates" (see request_body)."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    loop = asyncio.get_running_loop()
    if mock_outputs:
        mock_outputs = next_turn_outputs(requests)
    endpoints = [u.rstrip("/") + "/v1/completions" for u in ([url] if isinstance(url, str) else url)]
    outcomes: list[ReplayOutcome] = []
    done = 0
    # Prompts are built before the clock starts: materialising one costs ~1 ms per 10k tokens.
    bodies = [msgspec.json.encode(request_body(r, model, mock_outputs)) for r in requests]
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = loop.time()
        last_end = start

        async def one(i: int, req: TraceRequest, body: bytes) -> None:
            nonlocal done, last_end
            due = start + req.arrival_s / speedup
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            out = ReplayOutcome(req.request_id, req.arrival_s, req.input_tokens, req.output_tokens,
                                session_id=req.session_id, turn=req.turn)
            sent = loop.time()
            out.send_lag_s = max(0.0, sent - due) * speedup
            try:
                await asyncio.wait_for(send_request(session, endpoints[i % len(endpoints)], body, out,
                                                    sent, speedup, loop), timeout_s)
            except asyncio.TimeoutError:
                out.status, out.error = "failed", f"no complete answer within {timeout_s:g} s (wall)"
            except Exception as exc:  # noqa: BLE001 - connection errors, bad streams: this request failed
                out.status, out.error = "failed", f"{type(exc).__name__}: {exc}"
            last_end = max(last_end, loop.time())
            outcomes.append(out)
            done += 1
            if progress is not None:
                progress(done)

        await asyncio.gather(*(one(i, r, b) for i, (r, b) in enumerate(zip(requests, bodies))))
    outcomes.sort(key=lambda o: o.request_id)
    wall = last_end - start
    return ReplayResult(outcomes, wall * speedup, wall, speedup)


async def send_request(session: aiohttp.ClientSession, endpoint: str, body: bytes, out: ReplayOutcome,
                       sent: float, speedup: float, loop: asyncio.AbstractEventLoop) -> None:
    """POST one streamed completion; fill `out` (status, TTFT from `sent` to the first content
    chunk, ITL, TPOT, in model seconds) from its stream."""
    decode = msgspec.json.decode
    async with session.post(endpoint, data=body, headers={"Content-Type": "application/json"}) as resp:
        out.route = resp.headers.get("x-pd-route")
        # x-pd-route: "route=local|disaggregated, ..." (minimal) or "prefill=local|URL, ..." (full)
        out.disaggregated = out.route is not None and not out.route.startswith(("prefill=local",
                                                                                "route=local"))
        if resp.status >= 400:
            out.status = "rejected" if resp.status == 429 else "failed"
            out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return
        stamps: list[float] = []
        finished = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                finished = True
                break
            try:
                chunk = decode(data)
            except msgspec.DecodeError:
                out.status, out.error = "failed", f"undecodable stream chunk {data[:80]!r}"
                return
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                out.status, out.error = "failed", f"error event: {str(chunk['error'])[:300]}"
                return
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                stamps.append(loop.time())
        end = loop.time()
    if not finished:
        out.status, out.error = "failed", "the stream ended without [DONE]"
        return
    if not stamps:
        out.status, out.error = "failed", "no tokens"
        return
    out.status = "ok"
    out.tokens = len(stamps)
    out.ttft_s = (stamps[0] - sent) * speedup
    out.e2e_s = (end - sent) * speedup
    out.itl_s = [(b - a) * speedup for a, b in zip(stamps, stamps[1:])]
    if len(stamps) > 1:
        out.tpot_s = (stamps[-1] - stamps[0]) * speedup / (len(stamps) - 1)
