"""`pd-mock-engine --latency-model PRESET`: the mock's legs timed by the engine model.

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
-> expert t mod E, experts.py), and decode steps read the experts their batch uses
(perf/engine_model.py): requests on the same experts decode faster together (ELDR).

PD legs (engine.py runs them the same way for both timings):
- prefill: kind "prefill"; answers after its one step, with the prompt tokens it found cached in
  its `pd` section; its KV stays pinned until the decode reads the transfer from the side port (or
  after vLLM's 480 s abort timeout, in model time).
- remote decode: kind "remote_decode" (the engine model times the KV transfer); a pull starts at
  once, push and SGLang first wait for the prefill on the side port (side_channel.py).
- anything else: kind "local".
A request that can never fit in the KV cache answers 400; a client that leaves aborts its request.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from pd_plugins.mock.experts import mock_expert_pick
from pd_plugins.mock.kv_events import KvEventPublisher
from pd_plugins.mock.timing import Run, Timing, Work
from pd_plugins.perf.engine_model import EngineInstance, EngineRequest, StepResult
from pd_plugins.perf.hardware import preset
from pd_plugins.vocab.block_keys import block_keys

PREFILL_KV_TIMEOUT_S = 480.0
"""Model seconds a prefill keeps KV nobody fetched (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."""


class ModelledTiming(Timing):
    times_kv_transfer = True
    modelled = True

    def __init__(self, args: argparse.Namespace) -> None:
        self.driver = ModelDriver(args)
        self.unread_kv_hold_s = PREFILL_KV_TIMEOUT_S / args.speedup

    def start(self, work: Work, arrived: float | None = None) -> Run:
        return self.driver.submit(work.prompt_tokens, work.ids, work.output_tokens, work.kind, arrived,
                                  output_ids=work.output_ids)

    def now(self) -> float:
        return self.driver.now()

    async def open(self) -> None:
        self.driver.start()

    async def close(self) -> None:
        await self.driver.stop()

    def load(self, handling: int) -> tuple[float, float, float]:
        inst = self.driver.inst
        return inst.num_waiting, inst.num_running, inst.kv_usage

    def stats(self) -> dict[str, Any]:
        return self.driver.stats()


class Flight(Run):
    """One request in the model, as its HTTP handler sees it."""

    def __init__(self, driver: ModelDriver, req: EngineRequest, ids: list[int] | None,
                 output_ids: list[int] | None = None) -> None:
        self.driver, self.req = driver, req
        self.ids = ids                    # prompt token ids (None: a text prompt)
        self.output_ids = output_ids      # what it "generates", when the client said so
        self.event = asyncio.Event()
        self._released = False

    @property
    def error(self) -> str | None:
        return self.req.error

    @property
    def cached_tokens(self) -> int:
        return self.req.cached_tokens

    @property
    def first_token_at(self) -> float | None:
        return self.req.first_token_at

    async def progress(self) -> None:
        await self.event.wait()
        self.event.clear()

    def notify(self) -> None:
        self.event.set()

    def abort(self) -> None:
        self.driver.abort(self)
        if self.req.kind == "prefill" and self.req.error is None:  # finished as its client left:
            self.release()                                        # nobody will pull it

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.driver.release(self)

    def kv_accepted(self) -> None:
        self.driver.transfer_tokens += self.req.transfer_tokens


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
                flight.made += 1
                flight.notify()
        for req in result.failed:
            flight = req.rid
            flight.done = True
            flight.notify()
        for req in result.first_tokens:
            flight = req.rid
            flight.made = 1
            if req.kind != "prefill":
                self.decoding.add(flight)
            flight.notify()
        for req in result.finished:
            flight = req.rid
            if flight.output_ids and self.events is not None:
                self._publish_output_blocks(flight)
            flight.made = req.output_tokens
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
        flight = Flight(self, req, ids, output_ids if out_keys else None)
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
