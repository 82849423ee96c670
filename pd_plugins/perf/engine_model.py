"""One engine instance as vLLM runs it, step by step, with times from the roofline (hardware.py).

Scheduling follows vLLM V1: every step first gives each running decode one token, then fills the
rest of the token budget (`max_batched_tokens`) with chunks of waiting prefills, first come first
served. A request is admitted only when its blocks fit in the KV cache (kv_cache.py) after evicting
unpinned cached blocks; until then it waits, and the queue head blocks the rest (vLLM's FCFS). A
request holds its whole reservation (prompt and output) from admission to the end: no preemption.

Three kinds of request:
- `local`: prefill then decode here (aggregated serving, or a decode worker prefilling itself);
- `prefill`: a disaggregated prefill leg: one token, then its KV stays pinned until `release()`
  (the decode worker has pulled it);
- `remote_decode`: the decode leg: admitted, then loads the uncached part of the prompt's KV over
  the link (`Hardware.transfer_s`), then decodes every output token here.

With a host tier (`Hardware.host_kv_bytes`, kv_cache.py), blocks of the prompt that left GPU memory
but are still in host memory are loaded from there (`Hardware.host_load_s`) before the request
computes the rest; a decode leg loads them beside its transfer.

The model is driven from outside, so the same code runs under the simulator's event loop and the
mock engine's asyncio loop: `plan(now)` returns how long the next step takes (None when idle),
`finish(now)` ends it and returns what happened. Decode steps cost O(1) in the batch size: a
request finishes at a known step number, kept in a heap.

MoE decode steps read the experts their batch activates: routed uniformly, or as each request's
own expert mix says when the workload knows it (`expert_pick`, ELDR studies).

Simplifications (documented in docs/simulation.md): a prompt's keyed blocks enter the prefix cache
at admission, not as their chunks complete; decode steps within one step time are identical.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from pd_plugins.perf.hardware import Hardware
from pd_plugins.perf.kv_cache import KeysCallback, KvCache

Kind = Literal["local", "prefill", "remote_decode"]


@dataclass(slots=True, eq=False)
class EngineRequest:
    rid: object
    prompt_tokens: int
    output_tokens: int              # tokens generated here (a prefill leg: 1)
    block_keys: Sequence[int]       # keys of the prompt's full blocks, at the instance's block size
    kind: Kind = "local"
    # Keys of the blocks the output completes after the prompt's (a conversation's next turn starts
    # with them): cached here when the request finishes, as vLLM caches generated blocks.
    output_block_keys: Sequence[int] = ()
    # MoE, when known ([layers, experts]): the chance that one of its tokens picks each expert.
    # Decode steps then read the experts their batch actually uses (hardware.py).
    expert_pick: object = None
    # Filled in by the model:
    cached_tokens: int = 0          # prompt tokens found in this instance's prefix cache
    host_tokens: int = 0            # of those, tokens loaded from its host tier
    transfer_tokens: int = 0        # remote_decode: tokens pulled over the link
    submitted_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    _computed: int = 0              # prompt tokens computed so far (including cached)
    _ready_at: float = 0.0          # remote_decode: when its KV has arrived
    _private: int = 0
    _first_step: int = 0
    _finish_step: int = 0
    _expert_log: object = None

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(slots=True)
class StepResult:
    first_tokens: list[EngineRequest] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)   # includes finished prefill legs
    failed: list[EngineRequest] = field(default_factory=list)     # can never fit: `error` says why


class EngineInstance:
    def __init__(self, hw: Hardware, block_size: int = 16, max_batched_tokens: int = 8192,
                 max_running: int = 256, kv_capacity_tokens: int | None = None,
                 on_stored: KeysCallback | None = None, on_removed: KeysCallback | None = None):
        self.hw, self.block_size = hw, block_size
        self.max_batched_tokens, self.max_running = max_batched_tokens, max_running
        capacity = kv_capacity_tokens if kv_capacity_tokens is not None else hw.kv_capacity_tokens()
        self.cache = KvCache(capacity // block_size, on_stored, on_removed,
                             host_capacity_blocks=hw.host_capacity_tokens() // block_size)
        self.waiting: deque[EngineRequest] = deque()
        self.loading: list[EngineRequest] = []
        self.prefilling: list[EngineRequest] = []
        self._decoding: list[tuple[int, int, EngineRequest]] = []  # (finish step, seq, request)
        self._decode_kv_tokens = 0
        self._seq = itertools.count()
        self.steps = 0
        self.busy_s = 0.0
        self.prefill_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.prompt_tokens_from_host = 0  # of those, loaded from the host tier (not decode legs')
        self._step: tuple[list[tuple[EngineRequest, int]], list[EngineRequest], float] | None = None
        self._failed: list[EngineRequest] = []
        # sum over the decode batch of log(1 - p): 1 - mean(exp(.)) is the share of experts the
        # batch activates; None until a request with a known expert mix decodes here
        self._expert_log_free = None

    # -- what the router's scrape sees -------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self._decoding) + len(self.prefilling) + len(self.loading)

    @property
    def kv_usage(self) -> float:
        return self.cache.in_use_blocks / self.cache.capacity_blocks

    @property
    def in_step(self) -> bool:
        return self._step is not None

    # -- requests in -------------------------------------------------------------------------
    def submit(self, req: EngineRequest, now: float) -> None:
        req.submitted_at = now
        req._private = self._blocks(req.context_tokens) - len(req.block_keys)
        if len(req.block_keys) + req._private > self.cache.capacity_blocks:
            req.error = (f"needs {req.context_tokens} tokens of KV, more than this instance's "
                         f"{self.cache.capacity_blocks * self.block_size}")
            req.finished_at = now
            self._failed.append(req)
            return
        self.waiting.append(req)

    def release(self, req: EngineRequest) -> None:
        """A prefill leg's KV has been pulled: unpin it (its full blocks stay cached)."""
        self.cache.release(req.block_keys, req._private)

    def abort(self, req: EngineRequest, now: float) -> bool:
        """Drop a request nobody waits for any more (its client left), as vLLM aborts it: out of
        the queue or the batch, its blocks unpinned at once; a step in flight skips it. False when
        it had already finished (a finished prefill leg's KV is freed by `release()`)."""
        if req.finished_at is not None:
            return False
        req.error, req.finished_at = "aborted", now
        if req.admitted_at is None:
            if req in self.waiting:
                self.waiting.remove(req)
            return True
        if req in self.loading:
            self.loading.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)
        else:
            for i, entry in enumerate(self._decoding):
                if entry[2] is req:
                    self._decoding[i] = self._decoding[-1]
                    self._decoding.pop()
                    heapq.heapify(self._decoding)
                    # its context so far: the whole context less the tokens it has still to make
                    self._decode_kv_tokens -= req.context_tokens - (req._finish_step - self.steps)
                    self._expert_leave(req)
                    break
        self.cache.release(req.block_keys, req._private)
        return True

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    # -- steps -------------------------------------------------------------------------------
    def plan(self, now: float) -> float | None:
        """Start the next step; its duration, or None when there is nothing to do."""
        assert self._step is None, "finish() the running step first"
        self._admit(now)
        joining = []
        if self.loading:
            still = []
            for req in self.loading:
                if req._ready_at > now:
                    still.append(req)
                elif req.kind == "remote_decode":
                    self._start_decoding(req, first_token_in_this_step=True)
                    joining.append(req)
                else:  # its host-tier blocks have arrived: compute the rest
                    self.prefilling.append(req)
            self.loading = still
        budget = self.max_batched_tokens - len(self._decoding)
        chunks: list[tuple[EngineRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, req.prompt_tokens - req._computed)
            chunks.append((req, n))
            budget -= n
        if not chunks and not self._decoding:
            if self.loading or self._failed:
                wait = min((r._ready_at for r in self.loading), default=now) - now
                self._step = ([], [], now)
                return max(wait, 0.0)
            return None
        duration = self.hw.step_s([(n, req._computed) for req, n in chunks],
                                  len(self._decoding), self._decode_kv_tokens,
                                  self._decode_expert_share())
        self._step = (chunks, joining, now)
        return duration

    def finish(self, now: float) -> StepResult:
        assert self._step is not None, "plan() a step first"
        chunks, joining, started = self._step
        self._step = None
        result = StepResult(failed=self._failed)
        self._failed = []
        if not chunks and not self._decoding:
            return result  # a wait for KV to arrive
        self.steps += 1
        self.busy_s += now - started
        self._decode_kv_tokens += len(self._decoding)
        for req in joining:
            if req.finished_at is not None:  # aborted during the step
                continue
            req.first_token_at = now
            result.first_tokens.append(req)
        while self._decoding and self._decoding[0][0] <= self.steps:
            req = heapq.heappop(self._decoding)[2]
            self._decode_kv_tokens -= req.context_tokens
            self._expert_leave(req)
            self._done(req, now, result)
        for req, n in chunks:
            if req.finished_at is not None:  # aborted during the step
                continue
            req._computed += n
            self.prefill_tokens_computed += n
            if req._computed < req.prompt_tokens:
                continue
            self.prefilling.remove(req)
            req.first_token_at = now
            result.first_tokens.append(req)
            if req.kind == "prefill":
                req.finished_at = now
                result.finished.append(req)  # KV stays pinned until release()
            elif req.output_tokens <= 1:
                self._done(req, now, result)
            else:
                self._start_decoding(req, first_token_in_this_step=False)
        return result

    def _admit(self, now: float) -> None:
        cache, bs = self.cache, self.block_size
        while self.waiting and self.num_running < self.max_running:
            req = self.waiting[0]
            # blocks the device lacks but the host tier holds (before allocating writes them there)
            host = (cache.match_host(req.block_keys, cache.match(req.block_keys))
                    if cache.host_capacity_blocks else 0)
            hit = cache.try_allocate(req.block_keys, req._private)
            if hit is None:
                return  # the head does not fit yet: everything behind it waits too (FCFS)
            self.waiting.popleft()
            req.admitted_at = now
            if req.kind == "remote_decode":
                req.cached_tokens = min((hit + host) * bs, req.prompt_tokens)
                req.host_tokens = max(0, req.cached_tokens - hit * bs)
                req.transfer_tokens = req.prompt_tokens - req.cached_tokens
                req._ready_at = now + max(self.hw.transfer_s(req.transfer_tokens),
                                          self.hw.host_load_s(req.host_tokens))
                self.loading.append(req)
            else:
                # vLLM recomputes at least the last prompt token to get logits.
                req.cached_tokens = min((hit + host) * bs, req.prompt_tokens - 1)
                req.host_tokens = max(0, req.cached_tokens - hit * bs)
                req._computed = req.cached_tokens
                self.prompt_tokens_cached += req.cached_tokens
                if req.host_tokens:
                    req._ready_at = now + self.hw.host_load_s(req.host_tokens)
                    self.loading.append(req)
                else:
                    self.prefilling.append(req)
                self.prompt_tokens_from_host += req.host_tokens

    def _start_decoding(self, req: EngineRequest, first_token_in_this_step: bool) -> None:
        """Join the decode batch. A remote decode makes all its tokens here, starting with this
        step; a local request's first token came from its prefill."""
        remaining = req.output_tokens - (0 if first_token_in_this_step else 1)
        req._finish_step = self.steps + remaining
        self._decode_kv_tokens += req.prompt_tokens + (0 if first_token_in_this_step else 1)
        heapq.heappush(self._decoding, (req._finish_step, next(self._seq), req))
        self._expert_join(req)

    # -- MoE: which experts the decode batch reads -------------------------------------------
    def _expert_log(self, req: EngineRequest):
        m = self.hw.model
        if req.expert_pick is not None:
            return np.log1p(-np.minimum(np.asarray(req.expert_pick, dtype=np.float64), 0.999))
        if self._expert_log_free is None:
            return None
        # a request of unknown mix: uniform routing
        return np.full(self._expert_log_free.shape, np.log1p(-m.top_k / m.experts))

    def _expert_join(self, req: EngineRequest) -> None:
        if not self.hw.model.experts:
            return
        contribution = self._expert_log(req)
        if contribution is None:
            return
        if self._expert_log_free is None:
            self._expert_log_free = contribution.copy()
        else:
            self._expert_log_free += contribution
        req._expert_log = contribution

    def _expert_leave(self, req: EngineRequest) -> None:
        if req._expert_log is not None and self._expert_log_free is not None:
            self._expert_log_free -= req._expert_log
            req._expert_log = None

    def _decode_expert_share(self) -> float | None:
        if self._expert_log_free is None or not self._decoding:
            return None
        return float(1.0 - np.exp(self._expert_log_free).mean())

    def _done(self, req: EngineRequest, now: float, result: StepResult) -> None:
        req.finished_at = now
        self.cache.release(req.block_keys, req._private)
        if req.output_block_keys:
            self.cache.insert_cached(req.output_block_keys)
        result.finished.append(req)
