"""`pd-mock-engine --latency-model PRESET`: the mock's answers timed by the engine model.

One `EngineInstance` (perf/engine_model.py: continuous batching, prefix cache, bounded KV) per
process, stepped by an asyncio task on an accelerated clock: model time = wall time x `--speedup`.
The task plans a step, sleeps until the step's end (an absolute deadline, so jitter never adds up
while the engine is busy), finishes it and wakes the handlers whose requests moved; an idle engine
waits for the next submission. If the process falls behind (a speedup too high for the host), the
model still advances step by step and the wall clock catches up; `/mock/stats` reports the worst
lag (`max_lag_s`, model seconds).

Requests: a prompt of token ids keys its full blocks with the router's own `block_keys`, so the
prefix cache, the router's index and the KV events all agree; a text prompt counts ~4 characters
a token and caches nothing. `max_tokens` is exactly what is generated (as with ignore_eos).
With a MoE preset, a token-id prompt routes as the mock's `--moe-experts` capture says (token t
-> expert t mod E, engine.py `mock_expert_counts`), and decode steps read the experts their batch
uses (perf/engine_model.py): requests on the same experts decode faster together (ELDR).

PD legs:
- prefill (`do_remote_decode`, or any request to `--role prefill`): kind "prefill"; answers after
  its one step with the transfer params plus `"pd": {"cached_tokens": N}`; its KV stays pinned until
  the decode reads the transfer from the side port (or after vLLM's 480 s abort timeout, in model
  time).
- decode (`do_remote_prefill` / SGLang bootstrap): kind "remote_decode" (the engine model times the
  KV transfer). It peeks at the prefill's digest on the side port as it starts (push and SGLang
  first wait for the prefill there); at its first token it checks the digest (409 on a mismatch) and
  reads the transfer for good in the background, which frees the prefill's KV.
- anything else: kind "local".
A request that can never fit in the KV cache answers 400; a client that leaves aborts its request.

`GET /mock/timings`: for each leg that produced its first token, its prompt digest, its kind, and the
model times it reached the server and made that token. A replay subtracts these engine times from
the TTFT its client measured to learn what HTTP, the router and the processes' wake-ups cost.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from pd_plugins.mock.engine import (
    MockEngine, _chunk, _completion, _error, mock_expert_pick, output_words, prompt_tokens,
)
from pd_plugins.perf.engine_model import EngineInstance, EngineRequest, StepResult
from pd_plugins.perf.hardware import preset
from pd_plugins.routers.policy.prefix_index import block_keys

PREFILL_KV_TIMEOUT_S = 480.0
"""Model seconds a prefill keeps KV nobody fetched (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."""

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

TIMINGS_KEPT = 100_000
"""Legs /mock/timings remembers (the oldest go first): a replay's worth, in bounded memory."""


@dataclass(eq=False)
class Flight:
    """One request in the model, as its HTTP handler sees it."""

    req: EngineRequest
    ids: list[int] | None                 # prompt token ids (None: a text prompt)
    output_ids: list[int] | None = None   # what it "generates", when the client said so
    tokens: int = 0                       # output tokens made so far
    done: bool = False                    # finished, failed or aborted
    event: asyncio.Event = field(default_factory=asyncio.Event)

    async def changed(self) -> None:
        await self.event.wait()
        self.event.clear()

    def notify(self) -> None:
        self.event.set()


class KvEventPublisher:
    """vLLM's KV events on a ZMQ PUB socket: frames [topic, seq (8 bytes, big endian),
    msgpack([ts, [event, ...]])], each event a tagged map as vLLM's msgspec structs encode."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        import zmq
        self._zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.topic = topic.encode()
        self.seq = 0
        self.pending: list[dict] = []
        self.sent_events = 0
        self.encoder = msgspec.msgpack.Encoder()

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> None:
        self.pending.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                             "token_ids": token_ids, "block_size": block_size, "lora_id": None,
                             "medium": "GPU", "lora_name": None})

    def removed(self, hashes: list[int]) -> None:
        self.pending.append({"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"})

    def flush(self) -> None:
        if not self.pending:
            return
        payload = self.encoder.encode([time.time(), self.pending])
        try:
            self.sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload),
                                     flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass  # a PUB drops what no subscriber can take, as vLLM's does
        self.seq += 1
        self.sent_events += len(self.pending)
        self.pending = []

    def close(self) -> None:
        self.sock.close(linger=0)


class ModelDriver:
    """Steps one EngineInstance in model time on the running event loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.hw = preset(args.latency_model)
        self.speedup = args.speedup
        self.block_size = args.block_size
        self.events = KvEventPublisher(args.kv_events) if args.kv_events else None
        self.inst = EngineInstance(
            self.hw, args.block_size, args.max_batched_tokens, args.max_running, args.kv_capacity_tokens,
            on_stored=self._on_stored if self.events else None,
            on_removed=self.events.removed if self.events else None)
        self.wake = asyncio.Event()
        self.decoding: set[Flight] = set()
        self.transfer_tokens = 0            # KV tokens decodes pulled (and found to be their prompt's)
        self.max_lag_s = 0.0
        self.t0 = 0.0
        self.clock = 0.0
        self.idle = False
        self._arrived: float | None = None  # earliest arrival submitted while idle
        self._task: asyncio.Task | None = None

    # -- clock and loop ----------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        # time.monotonic(), not loop.time(): uvloop's loop clock is cached per loop iteration in
        # whole milliseconds, which at --speedup 20 would misplace arrivals by up to 20 model ms
        self.loop, self.t0 = loop, time.monotonic()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.events is not None:
            self.events.close()

    def now(self) -> float:
        """Model time now, by the wall clock."""
        return (time.monotonic() - self.t0) * self.speedup

    async def _run(self) -> None:
        inst = self.inst
        while True:
            self.wake.clear()
            duration = inst.plan(self.clock)
            if self.events is not None:
                self.events.flush()
            if duration is None:
                self.idle = True
                await self.wake.wait()
                self.idle = False
                # From idle, the model starts when the request reached the server: the mock's own
                # parsing is no part of the engine being modelled.
                arrived = self.now() if self._arrived is None else self._arrived
                self.clock, self._arrived = max(self.clock, arrived), None
                continue
            end = self.clock + duration
            deadline = self.t0 + end / self.speedup
            delay = deadline - time.monotonic()
            if delay <= 0:
                self.max_lag_s = max(self.max_lag_s, -delay * self.speedup)
                await asyncio.sleep(0)  # behind: still let the handlers run
            while delay > 0:  # uvloop's timers round to whole ms, so may fire early: sleep the rest
                await asyncio.sleep(delay)
                delay = deadline - time.monotonic()
            steps = inst.steps
            result = inst.finish(end)
            self.clock = end
            self._dispatch(result, stepped=inst.steps != steps)

    def _dispatch(self, result: StepResult, stepped: bool) -> None:
        if stepped:  # every running decode made one more token
            for flight in self.decoding:
                flight.tokens += 1
                flight.notify()
        for req in result.failed:
            flight = req.rid
            flight.done = True
            flight.notify()
        for req in result.first_tokens:
            flight = req.rid
            flight.tokens = 1
            if req.kind != "prefill":
                self.decoding.add(flight)
            flight.notify()
        for req in result.finished:
            flight = req.rid
            if flight.output_ids and self.events is not None:
                self._publish_output_blocks(flight)
            flight.tokens = req.output_tokens
            flight.done = True
            self.decoding.discard(flight)
            flight.notify()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, prompt_tokens: int, ids: list[int] | None, output_tokens: int, kind: str,
               arrived: float | None = None, output_ids: list[int] | None = None) -> Flight:
        """`arrived`: model time the request reached the server (default: now). `output_ids`:
        the tokens it is to "generate" (`mock_output_ids`): the full blocks they complete are
        cached when it finishes, as an engine caches generated blocks."""
        keys = block_keys(ids, self.block_size) if ids is not None else []
        out_keys: list[int] = []
        if ids is not None and output_ids and kind != "prefill":
            out_keys = block_keys(ids + output_ids, self.block_size)[len(keys):]
        req = EngineRequest(None, prompt_tokens, output_tokens, keys, kind, output_block_keys=out_keys)
        model = self.hw.model
        if model.experts and ids:  # MoE: decode steps read the experts this prompt's mix uses
            req.expert_pick = mock_expert_pick(ids, model.layers, model.experts, model.top_k)
        flight = Flight(req, ids, output_ids=output_ids if out_keys else None)
        req.rid = flight
        arrived = self.now() if arrived is None else arrived
        if self.idle and (self._arrived is None or arrived < self._arrived):
            self._arrived = arrived
        self.inst.submit(req, max(self.clock, arrived))
        self.wake.set()
        return flight

    def abort(self, flight: Flight) -> None:
        if self.inst.abort(flight.req, max(self.clock, self.now())):
            flight.done = True
            self.decoding.discard(flight)
            self.wake.set()

    def release(self, flight: Flight) -> None:
        """A prefill leg's KV was pulled (or given up on)."""
        self.inst.release(flight.req)
        self.wake.set()

    def _publish_output_blocks(self, flight: Flight) -> None:
        """BlockStored for the blocks a finished request's output completed (cached by the
        engine model as it finished), chained on its last prompt block."""
        req, size = flight.req, self.block_size
        keys = list(req.output_block_keys)
        first = len(req.block_keys)
        tokens = (flight.ids + flight.output_ids)[first * size:(first + len(keys)) * size]
        self.events.stored(keys, req.block_keys[-1] if req.block_keys else None, tokens, size)

    def _on_stored(self, keys: list[int]) -> None:
        """KvCache stored `keys`: it does so while admitting the head of the queue. One
        BlockStored per run of consecutive blocks, chained on the block before the run."""
        for req in self.inst.waiting:  # the head, unless the engine model changes its ways
            if keys and keys[0] in req.block_keys:
                break
        else:
            return
        flight: Flight = req.rid
        if flight.ids is None:
            return
        pos = {k: i for i, k in enumerate(req.block_keys)}
        idx = [pos[k] for k in keys if k in pos]
        size, bk, start = self.block_size, req.block_keys, 0
        for j in range(1, len(idx) + 1):
            if j == len(idx) or idx[j] != idx[j - 1] + 1:
                first, last = idx[start], idx[j - 1]
                self.events.stored(list(bk[first:last + 1]), bk[first - 1] if first else None,
                                   flight.ids[first * size:(last + 1) * size], size)
                start = j

    # -- what the router scrapes and tests read ----------------------------------------------
    def metrics(self) -> str:
        inst = self.inst
        return (f"vllm:num_requests_waiting {inst.num_waiting}\n"
                f"vllm:num_requests_running {inst.num_running}\n"
                f"vllm:kv_cache_usage_perc {inst.kv_usage:.6f}\n"
                f"sglang:num_queue_reqs {inst.num_waiting}\n"
                f"sglang:num_running_reqs {inst.num_running}\n"
                f"sglang:token_usage {inst.kv_usage:.6f}\n")

    def stats(self) -> dict[str, Any]:
        inst = self.inst
        return {"prefill_tokens_computed": inst.prefill_tokens_computed,
                "prompt_tokens_cached": inst.prompt_tokens_cached,
                "transfer_tokens": self.transfer_tokens,
                "transfer_bytes": self.hw.kv_bytes(self.transfer_tokens),
                "steps": inst.steps, "model_time_s": self.now(), "busy_s": inst.busy_s,
                "max_lag_s": self.max_lag_s, "waiting": inst.num_waiting,
                "engine_running": inst.num_running, "kv_usage": inst.kv_usage,
                "evicted_blocks": inst.cache.evicted_blocks,
                "kv_events_sent": self.events.sent_events if self.events else 0}


def token_ids(body: dict[str, Any]) -> list[int] | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return prompt
    return None


def mock_output_ids(body: dict[str, Any]) -> list[int] | None:
    """The replay's `mock_output_ids` (perf.replay.request_body), if well formed."""
    ids = body.get("mock_output_ids")
    if isinstance(ids, list) and all(type(t) is int for t in ids):
        return ids
    return None


class ModelledServing:
    """The generate handler's modelled half (MockEngine.generate does parsing and faults)."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self.driver = ModelDriver(engine.s.args)
        self.pinned: dict[str, tuple[Flight, asyncio.TimerHandle]] = {}  # transfer key -> prefill leg
        self.timings: deque[dict[str, Any]] = deque(maxlen=TIMINGS_KEPT)  # /mock/timings
        self._background: set[asyncio.Task] = set()

    async def start(self, _app: web.Application) -> None:
        self.driver.start()

    async def stop(self, _app: web.Application) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.driver.stop()

    def room_read(self, key: str) -> None:
        """The decode read the transfer under `key`: the prefill's KV is free again."""
        entry = self.pinned.pop(key, None)
        if entry is not None:
            entry[1].cancel()
            self.driver.release(entry[0])

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _wait(self, flight: Flight, until) -> None:
        """Wait for the model to move this request until `until(flight)`; abort it if the client
        goes away (the handler is cancelled)."""
        try:
            while not until(flight):
                await flight.changed()
        except asyncio.CancelledError:
            self.driver.abort(flight)
            raise

    async def generate(self, request: web.Request, body: dict, chat: bool, digest: str, key: str | None,
                       kv: dict, is_prefill: bool, max_tokens: int, arrived: float) -> web.StreamResponse:
        e, s = self.engine, self.engine.s
        ids = token_ids(body)
        n_prompt = len(ids) if ids is not None else prompt_tokens(body)
        driver = self.driver
        if is_prefill:
            s.stats["prefill_legs"] += 1
            flight = driver.submit(n_prompt, ids, 1, "prefill", arrived)
            try:
                await self._wait(flight, lambda f: f.done)
            except asyncio.CancelledError:
                if flight.req.error is None:  # finished as the client left: nobody will pull it
                    driver.release(flight)
                raise
            if flight.req.error is not None:
                return _error(400, flight.req.error)
            self._timed(digest, flight.req, arrived)
            if key is None:
                driver.release(flight)
            else:
                e.register_room(key, digest)
                timer = asyncio.get_running_loop().call_later(
                    PREFILL_KV_TIMEOUT_S / driver.speedup, self.room_read, key)
                self.pinned[key] = (flight, timer)
            params = e.transfer_params(key)
            params["pd"] = {"cached_tokens": flight.req.cached_tokens}
            return web.Response(body=msgspec.json.encode(_completion(
                chat, s.args.model, output_words(digest, 1), n_prompt, params)), content_type="application/json")

        peek = None
        if key is not None:
            s.stats["remote_decodes"] += 1
            peek = asyncio.create_task(e.fetch_kv(kv, body, key, peek=True))
            pull = s.args.engine == "vllm" and "remote_block_ids" in kv
            if not pull:  # push and SGLang: the prefill is still running; its KV lands when done
                try:
                    held = await peek
                except asyncio.CancelledError:
                    self._spawn(e.fetch_kv(kv, body, key))
                    raise
                if held != digest:
                    s.stats["mismatched_kv"] += 1
                    self._spawn(e.fetch_kv(kv, body, key))
                    return _error(409, f"KV under {key} belongs to another prompt")
            flight = driver.submit(n_prompt, ids, max_tokens, "remote_decode",
                                   arrived if pull else None, output_ids=mock_output_ids(body))
        else:
            s.stats["local"] += 1
            flight = driver.submit(n_prompt, ids, max_tokens, "local", arrived,
                                   output_ids=mock_output_ids(body))
        try:
            await self._wait(flight, lambda f: f.tokens > 0 or f.done)
            if peek is not None:
                held = await peek
        except asyncio.CancelledError:
            if peek is not None:
                peek.cancel()
                self._spawn(e.fetch_kv(kv, body, key))
            raise
        if peek is not None:
            self._spawn(e.fetch_kv(kv, body, key))  # read it for good: frees the prefill's KV
            if held != digest:
                driver.abort(flight)
                s.stats["mismatched_kv"] += 1
                return _error(409, f"KV under {key} belongs to another prompt")
            driver.transfer_tokens += flight.req.transfer_tokens  # KV accepted (it is the prompt's)
        if flight.req.error is not None:
            return _error(400, flight.req.error)
        self._timed(digest, flight.req, arrived)
        words = output_words(digest, max_tokens)
        if not body.get("stream"):
            await self._wait(flight, lambda f: f.done)
            if flight.req.error is not None:
                return _error(400, flight.req.error)
            return web.Response(body=msgspec.json.encode(_completion(chat, s.args.model, words, n_prompt)),
                                content_type="application/json")
        return await self._stream(request, body, chat, flight, words, n_prompt)

    def _timed(self, digest: str, req: EngineRequest, arrived: float) -> None:
        if req.first_token_at is not None:
            self.timings.append({"prompt": digest, "leg": req.kind, "arrived_s": arrived,
                                 "first_token_s": req.first_token_at})

    async def _stream(self, request: web.Request, body: dict, chat: bool, flight: Flight,
                      words: list[str], n_prompt: int) -> web.StreamResponse:
        s, model = self.engine.s, self.engine.s.args.model
        encode = msgspec.json.encode
        out = web.StreamResponse(headers=SSE_HEADERS)
        await out.prepare(request)
        s.streaming += 1
        sent, total = 0, len(words)
        brk = s.faults.break_stream_after if s.faults.break_stream_after < total else 0
        try:
            while True:
                upto = min(flight.tokens, brk or total)
                if upto > sent:
                    await out.write(b"".join(
                        b"data: " + encode(_chunk(chat, model, words[i], "length" if i == total - 1 else None))
                        + b"\n\n" for i in range(sent, upto)))
                    sent = upto
                if brk and sent >= brk:
                    self.driver.abort(flight)
                    request.transport.close()  # an abrupt end, as when the engine dies
                    return out
                if flight.done:
                    break
                await flight.changed()
            if sent < total:  # aborted or failed mid-way (cannot happen without an abort)
                await out.write(b"data: " + encode({"error": {"message": flight.req.error or "aborted",
                                                              "code": 500}}) + b"\n\n")
            elif (body.get("stream_options") or {}).get("include_usage"):
                usage = {**_chunk(chat, model, "", None), "choices": [],
                         "usage": {"prompt_tokens": n_prompt, "completion_tokens": total,
                                   "total_tokens": n_prompt + total}}
                await out.write(b"data: " + encode(usage) + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except ConnectionResetError:  # the client left
            self.driver.abort(flight)
        except asyncio.CancelledError:
            self.driver.abort(flight)
            raise
        finally:
            s.streaming -= 1
        return out
