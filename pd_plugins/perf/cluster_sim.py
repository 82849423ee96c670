"""A discrete-event simulator of a PD cluster, routed by pd-router's own scheduler and accounting.

Each prefill and decode instance is an `EngineInstance` (engine_model.py); the router side is the
real `Scheduler` built from a preset or a `PolicySpec`, over a real `WorkerPool`, `PrefixIndex` and
`LatencyModels`, updated by the same accounting functions the proxy calls (routers/accounting.py).
So a policy measured here is the policy that ships. The flow is vLLM's pull flow, as the proxy
drives it: prefill leg (one token), then the decode leg, whose engine pulls the prompt's KV (less
what it already caches) and generates; the prefill instance frees that KV once it has been pulled.

What the router knows, as in production: its own in-flight accounting at once; engine queue and KV
usage by a scrape every `scrape_interval_s`; prefix residency either from KV events (`events`: the
instances' cache stores and evictions, at once) or from its own routing history (`routed`).
All instances cache at the trace's prefix-block size (512 tokens), the granularity its hashes
have. Deterministic: the same inputs and seed give the same result.

Role changes over time (live planning): instances can move between the prefill and decode pools,
at set times (`SimConfig.role_changes`) or as a controller decides from each window's traffic
(`SimConfig.role_controller`, called every `control_interval_s`). A move is what the router's
`POST /admin/workers/role` does: the worker stops taking new requests of its old role, finishes
what it holds (every request routed to it, a decode chosen while its prefill runs included), then
joins the other pool with its KV cache as it was (the engine is kv_both: no restart).
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

from pd_plugins.perf.engine_model import EngineInstance, EngineRequest
from pd_plugins.perf.hardware import Hardware
from pd_plugins.routers import accounting
from pd_plugins.routers.config import LatencySpec, PolicySpec, SessionSpec, WorkerSpec
from pd_plugins.routers.policy import PolicyContext, RequestInfo, Scheduler
from pd_plugins.routers.policy.latency_model import LatencyModels
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.routers.policy.scheduler import preset
from pd_plugins.routers.sessions import SessionTable
from pd_plugins.routers.workers import WorkerPool
from pd_plugins.workloads import TraceRequest
from pd_plugins.workloads.experts import ExpertMixes
from pd_plugins.workloads.trace import HASH_BLOCK_SIZE

PrefixSource = Literal["events", "routed"]
Role = Literal["prefill", "decode"]


@dataclass(slots=True)
class RequestOutcome:
    """One request's fate, in simulated seconds from its arrival."""

    request_id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    status: str = "ok"               # ok | rejected | failed
    ttft_s: float | None = None
    tpot_s: float | None = None      # mean time per output token after the first
    e2e_s: float | None = None
    disaggregated: bool = True
    prefill: int | None = None       # instance indices (within the role the instance began in)
    decode: int | None = None
    prefill_url: str | None = None   # the instances by name: unambiguous once roles change
    decode_url: str | None = None
    cached_tokens: int = 0           # prompt tokens the computing instance had cached
    transfer_tokens: int = 0         # tokens of KV moved prefill -> decode
    prefill_leg_s: float | None = None   # where the TTFT went: the prefill engine's share ...
    decode_first_s: float | None = None  # ... and the decode engine's (queue, KV pull, first step)
    session_id: str | None = None
    turn: int = 0


@dataclass
class SimConfig:
    hardware: Hardware
    prefill_instances: int = 8
    decode_instances: int = 8
    policy: str | PolicySpec = "prefix_cache"
    prefix_source: PrefixSource = "events"
    max_batched_tokens: int = 8192
    # the decode instances' token budget per step, if not the same: a small one makes a prefill
    # on a decode (append-prefill, local prefill) run in chunks beside the decodes (Sarathi-style)
    decode_max_batched_tokens: int | None = None
    max_running: int = 256
    kv_capacity_tokens: int | None = None  # default: what fits in GPU memory (hardware.py)
    scrape_interval_s: float = 1.0
    leg_network_s: float = 0.0005     # one router -> engine HTTP hop
    sessions: SessionSpec = field(default_factory=SessionSpec)  # when the policy tracks them
    # MoE expert mixes per request (workloads/experts.py): decode steps read the experts their
    # batch uses, and the router learns each prompt's signature when its prefill answers
    expert_mixes: ExpertMixes | None = None
    # tokens per cached block, in the engines and the router's prefix index: the requests' own
    # (`TraceRequest.block_tokens`; run() refuses requests hashed at another size)
    block_tokens: int = HASH_BLOCK_SIZE
    seed: int = 0
    # live role changes: moves at set times, and/or a controller called every control interval
    # with that window's traffic, returning the split it wants (None: keep the current one)
    role_changes: tuple[RoleChange, ...] = ()
    role_controller: Callable[[TrafficWindow], tuple[int, int] | None] | None = None
    control_interval_s: float = 60.0


@dataclass(frozen=True)
class RoleChange:
    """Move the instance first named `url` (e.g. "http://sim-decode-3") to role `to` at `at_s`."""

    at_s: float
    url: str
    to: Role


@dataclass(frozen=True)
class TrafficWindow:
    """What a controller sees at `end_s`: the requests that arrived in [start_s, end_s), those
    that ended in it, the split with moves in progress counted at their destination, and the
    requests not ended yet (as a router knows them: `ttft_s` set once the first token came)."""

    start_s: float
    end_s: float
    arrivals: list[TraceRequest]
    ended: list[RequestOutcome]
    prefill: int
    decode: int
    moving: int
    in_flight: list[RequestOutcome] = field(default_factory=list)


@dataclass(slots=True)
class RoleMove:
    url: str
    from_role: Role
    to: Role
    asked_at_s: float
    drained: int                    # requests it still held when asked
    done_at_s: float | None = None  # when it began serving its new role (None: still draining)


@dataclass
class SimResult:
    config: SimConfig
    outcomes: list[RequestOutcome]
    sim_span_s: float
    prefill_tokens_computed: int
    prompt_tokens_cached: int
    kv_bytes_moved: float
    instance_busy_s: dict[str, float] = field(default_factory=dict)
    role_moves: list[RoleMove] = field(default_factory=list)
    # (time, prefill, decode) each time the serving split changed, from (0, initial split)
    split_log: list[tuple[float, int, int]] = field(default_factory=list)
    # of the cached ones, loaded from host tiers (as cached ones: not decode legs')
    prompt_tokens_from_host: int = 0


@dataclass(slots=True, eq=False)
class _Flight:
    trace: TraceRequest
    info: RequestInfo
    outcome: RequestOutcome
    decision: object = None
    charge: accounting.PrefillCharge | None = None  # a prefill leg's charge on its worker
    local_uncached: int = 0         # a local prefill's charge on its decode worker
    decode_charge: accounting.DecodeCharge | None = None  # its decode leg's charge there
    prefill_sent_at: float = 0.0
    prefill_leg: EngineRequest | None = None


def latency_priors(hw: Hardware) -> LatencySpec:
    """The priors an operator would configure for this hardware (the router refits them online)."""
    if hasattr(hw, "latency_priors"):  # a router's calibration (perf/calibration.py): its fit
        return hw.latency_priors()
    per_token = hw.prefill_s(2048) - hw.prefill_s(1024)
    return LatencySpec(prefill_base_s=max(0.0, hw.prefill_s(1024) - 1024 * per_token / 1024),
                       prefill_per_token_s=per_token / 1024,
                       decode_step_base_s=hw.decode_step_s(1, 2048),
                       decode_step_per_request_s=hw.decode_step_s(33, 33 * 2048) / 33
                       - hw.decode_step_s(1, 2048) / 33,
                       kv_bytes_per_token=hw.model.kv_bytes_per_token,
                       link_bytes_per_s=hw.link_bytes_per_s)


class ClusterSim:
    def __init__(self, config: SimConfig) -> None:
        self.config = c = config
        random.seed(c.seed)  # pickers with an unseeded RNG stay reproducible
        spec = preset(c.policy) if isinstance(c.policy, str) else c.policy
        self.pool = WorkerPool()
        self.index = PrefixIndex()
        self.ctx = PolicyContext(self.pool, self.index, LatencyModels(latency_priors(c.hardware)),
                                 c.block_tokens)
        self.scheduler = Scheduler(spec, self.ctx)
        self.record_prefixes = self.scheduler.uses_prefix_index and c.prefix_source == "routed"
        self.workers, self.instances = {}, {}
        for role, count in (("prefill", c.prefill_instances), ("decode", c.decode_instances)):
            for i in range(count):
                url = f"http://sim-{role}-{i}"
                worker = self.pool.add(WorkerSpec(url=url), role)
                worker.ever_up = True
                events = c.prefix_source == "events"
                inst = EngineInstance(
                    c.hardware, c.block_tokens,
                    c.decode_max_batched_tokens or c.max_batched_tokens if role == "decode"
                    else c.max_batched_tokens, c.max_running, c.kv_capacity_tokens,
                    on_stored=(lambda keys, u=url: self.index.store_keys(u, keys)) if events else None,
                    on_removed=(lambda keys, u=url: self.index.remove_keys(u, keys)) if events else None)
                inst.name, inst.index = url, i
                self.workers[inst] = worker
                self.instances[worker] = inst
        self._events: list = []
        self._seq = itertools.count()
        self.kv_bytes_moved = 0.0
        self._now = 0.0
        self.sessions = (SessionTable(c.sessions, clock=lambda: self._now)
                         if self.scheduler.uses_sessions else None)
        self._output_keys: dict[int, tuple[int, ...]] = {}
        # live role changes: requests routed to each worker and not ended yet (a decode chosen
        # while its prefill runs counts), the moves in progress, what each window saw
        self._held: dict = {}
        self._moving: dict = {}  # old worker -> its RoleMove, while it drains
        self.role_moves: list[RoleMove] = []
        self.split_log = [(0.0, c.prefill_instances, c.decode_instances)]
        self._window_arrivals: list[TraceRequest] = []
        self._window_ended: list[RequestOutcome] = []
        self._in_flight: dict[int, RequestOutcome] = {}
        self._window_start = 0.0

    # -- the event loop ----------------------------------------------------------------------
    def _at(self, t: float, action: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), action, args))

    def run(self, requests: Iterable[TraceRequest],
            progress: Callable[[int], None] | None = None) -> SimResult:
        requests = list(requests)
        sizes = {r.block_tokens for r in requests} - {self.config.block_tokens}
        if sizes:
            raise ValueError(f"requests hashed at {', '.join(map(str, sorted(sizes)))}-token "
                             f"blocks, the simulator caches at {self.config.block_tokens} "
                             "(SimConfig.block_tokens)")
        self._output_keys = context_keys(requests)
        for r in requests:
            self._at(r.arrival_s, self._arrive, r)
        if self.config.scrape_interval_s > 0:
            self._at(0.0, self._scrape)
        for change in self.config.role_changes:
            self._at(change.at_s, self._role_change, change)
        if self.config.role_controller is not None:
            self._at(self.config.control_interval_s, self._control)
        outcomes: list[RequestOutcome] = []
        self._outcomes, self._progress = outcomes, progress
        now = 0.0
        while self._events and len(outcomes) < len(requests):
            now, _, action, args = heapq.heappop(self._events)
            self._now = now
            action(now, *args)
        outcomes.sort(key=lambda o: o.request_id)
        insts = list(self.workers)
        return SimResult(self.config, outcomes, now,
                         sum(i.prefill_tokens_computed for i in insts),
                         sum(i.prompt_tokens_cached for i in insts), self.kv_bytes_moved,
                         {i.name: i.busy_s for i in insts}, self.role_moves, self.split_log,
                         sum(i.prompt_tokens_from_host for i in insts))

    def _kick(self, inst: EngineInstance, now: float) -> None:
        if inst.in_step:
            return
        duration = inst.plan(now)
        if duration is not None:
            self._at(now + duration, self._step_done, inst)

    def _scrape(self, now: float) -> None:
        for inst, worker in self.workers.items():
            worker.engine_waiting = float(inst.num_waiting)
            worker.engine_running = float(inst.num_running)
            worker.kv_usage = inst.kv_usage
        self._at(now + self.config.scrape_interval_s, self._scrape)

    # -- role changes ------------------------------------------------------------------------
    def _split(self) -> tuple[int, int]:
        """(prefill, decode) with moves in progress counted at their destination."""
        counts = {"prefill": 0, "decode": 0}
        for worker in self.pool:
            move = self._moving.get(worker)
            counts[move.to if move else worker.role] += 1
        return counts["prefill"], counts["decode"]

    def _role_change(self, now: float, change: RoleChange) -> None:
        inst = next((i for i in self.workers if i.name == change.url), None)
        if inst is None:
            raise ValueError(f"role change for unknown instance {change.url}")
        self._move(now, self.workers[inst], change.to)

    def _move(self, now: float, worker, to: Role) -> bool:
        """Start moving `worker` to `to`; refused (False), as the router answers 409, when it
        already serves that role or is moving, or when it is the last of its pool."""
        if worker.role == to or worker in self._moving:
            return False
        if sum(1 for w in self.pool.by_role(worker.role) if w not in self._moving) <= 1:
            return False
        move = RoleMove(worker.url, worker.role, to, now, self._held.get(worker, 0))
        self._moving[worker] = move
        self.role_moves.append(move)
        worker.draining = True  # the scheduler no longer picks it for its old role
        self._drained(now, worker)
        return True

    def _hold(self, now: float, worker, n: int) -> None:
        self._held[worker] = self._held.get(worker, 0) + n
        if n < 0:
            self._drained(now, worker)

    def _drained(self, now: float, worker) -> None:
        """Once a moving worker holds nothing of its old role: serve the new one."""
        move = self._moving.get(worker)
        if move is None or self._held.get(worker, 0) > 0:
            return
        del self._moving[worker]
        inst = self.instances[worker]  # the old Worker keeps mapping here: late KV releases
        self.pool.remove(worker.url, worker.role)
        new = self.pool.add(WorkerSpec(url=worker.url), move.to)
        new.ever_up = True
        new.engine_waiting, new.engine_running, new.kv_usage = (
            worker.engine_waiting, worker.engine_running, worker.kv_usage)
        self.workers[inst] = new
        self.instances[new] = inst
        c = self.config
        inst.max_batched_tokens = (c.decode_max_batched_tokens or c.max_batched_tokens
                                   if move.to == "decode" else c.max_batched_tokens)
        move.done_at_s = now
        self.split_log.append((now, *self._split()))

    def _control(self, now: float) -> None:
        prefill, decode = self._split()
        window = TrafficWindow(self._window_start, now, self._window_arrivals, self._window_ended,
                               prefill, decode, len(self._moving), list(self._in_flight.values()))
        self._window_arrivals, self._window_ended, self._window_start = [], [], now
        want = self.config.role_controller(window)
        if want is not None:
            to_prefill = max(1, min(prefill + decode - 1, want[0])) - prefill
            source: Role = "decode" if to_prefill > 0 else "prefill"
            for _ in range(abs(to_prefill)):
                # the one holding the least work of its old role drains soonest
                idle = sorted((w for w in self.pool.by_role(source) if w not in self._moving),
                              key=lambda w: (self._held.get(w, 0), w.url))
                if not idle or not self._move(now, idle[0], "prefill" if to_prefill > 0 else "decode"):
                    break
        self._at(now + self.config.control_interval_s, self._control)

    # -- a request's life --------------------------------------------------------------------
    def _arrive(self, now: float, r: TraceRequest) -> None:
        if self.config.role_controller is not None:
            self._window_arrivals.append(r)
        info = RequestInfo(prompt_tokens=r.input_tokens, block_keys=list(r.full_block_hashes()),
                           max_tokens=r.output_tokens, session_id=r.session_id)
        outcome = RequestOutcome(r.request_id, r.arrival_s, r.input_tokens, r.output_tokens,
                                 session_id=r.session_id, turn=r.turn)
        if self.config.role_controller is not None:
            self._in_flight[r.request_id] = outcome
        flight = _Flight(r, info, outcome)
        if self.sessions is not None:
            self.sessions.resolve(info)
        decision = self.scheduler.schedule(info)  # admission judges the route (as the proxy)
        if decision is None:
            self._end(flight, "failed")
            return
        if self.scheduler.admit(info, decision) is not None:
            self._end(flight, "rejected")
            return
        flight.decision = decision
        outcome.decode = self.instances[decision.decode].index
        outcome.decode_url = decision.decode.url
        self._hold(now, decision.decode, 1)
        if decision.prefill is None:
            outcome.disaggregated = False
            flight.decode_charge = accounting.decode_started(decision.decode, info)
            flight.local_uncached = accounting.local_prefill_started(self.ctx, decision.decode, info)
            self._submit(flight, decision.decode, "local", r.output_tokens, now + self.config.leg_network_s)
            return
        outcome.prefill = self.instances[decision.prefill].index
        outcome.prefill_url = decision.prefill.url
        self._hold(now, decision.prefill, 1)
        flight.charge = accounting.prefill_started(self.ctx, decision.prefill, info)
        flight.prefill_sent_at = now
        flight.prefill_leg = self._submit(flight, decision.prefill, "prefill", 1,
                                          now + self.config.leg_network_s)

    def _submit(self, flight: _Flight, worker, kind: str, output_tokens: int, at: float) -> EngineRequest:
        req = EngineRequest(flight, flight.info.prompt_tokens, output_tokens, flight.info.block_keys, kind,
                            output_block_keys=() if kind == "prefill"
                            else self._output_keys.get(flight.trace.request_id, ()))
        mixes = self.config.expert_mixes
        if mixes is not None and kind != "prefill":
            req.expert_pick = mixes.pick(flight.trace.request_id)
        self._at(at, self._deliver, self.instances[worker], req)
        return req

    def _deliver(self, now: float, inst: EngineInstance, req: EngineRequest) -> None:
        inst.submit(req, now)
        self._kick(inst, now)

    def _step_done(self, now: float, inst: EngineInstance) -> None:
        result = inst.finish(now)
        for req in result.failed:
            self._leg_failed(now, inst, req)
        for req in result.first_tokens:
            if req.kind != "prefill":
                self._first_token(now, req)
        for req in result.finished:
            if req.kind == "prefill":
                self._prefill_done(now, inst, req)
            else:
                self._decode_done(now, req)
        self._kick(inst, now)

    def _prefill_done(self, now: float, inst: EngineInstance, req: EngineRequest) -> None:
        flight: _Flight = req.rid
        worker = self.workers[inst]
        info = flight.info
        accounting.prefill_ended(worker, info, flight.charge)
        accounting.prefill_succeeded(self.ctx, worker, info, flight.charge,
                                     now + self.config.leg_network_s - flight.prefill_sent_at,
                                     req.cached_tokens, self.record_prefixes)
        flight.outcome.cached_tokens = req.cached_tokens
        flight.outcome.prefill_leg_s = now - req.submitted_at
        mixes = self.config.expert_mixes
        if mixes is not None and self.scheduler.uses_expert_signatures:
            # the prefill's answer carries the prompt's expert signature: choose the decode again
            info.expert_histogram = mixes.histogram(flight.trace.request_id, info.prompt_tokens)
            before = flight.decision.decode
            flight.decision = self.scheduler.rebind_decode(info, flight.decision)
            self._hold(now, flight.decision.decode, 1)
            self._hold(now, before, -1)
            flight.outcome.decode = self.instances[flight.decision.decode].index
            flight.outcome.decode_url = flight.decision.decode.url
        decode = flight.decision.decode
        flight.decode_charge = accounting.decode_started(decode, info)
        self._hold(now, worker, -1)
        # The answer travels back to the router, the decode leg out to the decode engine.
        self._submit(flight, decode, "remote_decode", flight.trace.output_tokens,
                     now + 2 * self.config.leg_network_s)

    def _first_token(self, now: float, req: EngineRequest) -> None:
        flight: _Flight = req.rid
        flight.outcome.ttft_s = now + self.config.leg_network_s - flight.trace.arrival_s
        flight.outcome.decode_first_s = now - req.submitted_at
        if req.kind == "remote_decode":
            flight.outcome.transfer_tokens = req.transfer_tokens
            self.kv_bytes_moved += self.config.hardware.kv_bytes(req.transfer_tokens)
            prefill_inst = self.instances[flight.decision.prefill]
            prefill_inst.release(flight.prefill_leg)  # pulled: the prefill's blocks are free again
            self._kick(prefill_inst, now)
        else:
            flight.outcome.cached_tokens = req.cached_tokens
            accounting.local_prefill_ended(flight.decision.decode, flight.local_uncached)

    def _decode_done(self, now: float, req: EngineRequest) -> None:
        flight: _Flight = req.rid
        outcome, decode = flight.outcome, flight.decision.decode
        end = now + self.config.leg_network_s
        outcome.e2e_s = end - flight.trace.arrival_s
        if req.output_tokens > 1:
            outcome.tpot_s = (now - req.first_token_at) / (req.output_tokens - 1)
            accounting.decode_observed(self.ctx, decode, outcome.tpot_s)
        accounting.decode_ended(decode, flight.info, flight.decode_charge)
        accounting.request_succeeded(self.ctx, decode, flight.info, self.record_prefixes)
        if self.sessions is not None:
            self.sessions.record(flight.info, decode.url)
        self._hold(now, decode, -1)
        self._end(flight, "ok")

    def _leg_failed(self, now: float, inst: EngineInstance, req: EngineRequest) -> None:
        flight: _Flight = req.rid
        worker = self.workers[inst]
        if req.kind == "prefill":
            accounting.prefill_ended(worker, flight.info, flight.charge)
        else:
            accounting.decode_ended(worker, flight.info, flight.decode_charge)
        if req.kind == "local":
            accounting.local_prefill_ended(worker, flight.local_uncached)
        if req.kind == "remote_decode":  # its prefill's KV will never be pulled now
            prefill_inst = self.instances[flight.decision.prefill]
            prefill_inst.release(flight.prefill_leg)
            self._kick(prefill_inst, now)
        if req.kind == "prefill":
            self._hold(now, worker, -1)
        self._hold(now, flight.decision.decode, -1)
        self._end(flight, "failed")

    def _end(self, flight: _Flight, status: str) -> None:
        flight.outcome.status = status
        self._outcomes.append(flight.outcome)
        if self.config.role_controller is not None:
            self._window_ended.append(flight.outcome)
            self._in_flight.pop(flight.outcome.request_id, None)
        if self._progress is not None:
            self._progress(len(self._outcomes))


def context_keys(requests: list[TraceRequest]) -> dict[int, tuple[int, ...]]:
    """For each turn followed by another in its session: the keys of the full blocks its output
    completes (the next turn's prompt holds them, so the decode worker has them cached)."""
    out, last = {}, {}
    for r in requests:  # in arrival order, so a session's turns come in order
        if r.session_id is None:
            continue
        prev = last.get(r.session_id)
        if prev is not None:
            keys = r.full_block_hashes()
            done = len(prev.full_block_hashes())
            upto = min(len(keys), (prev.input_tokens + prev.output_tokens) // r.block_tokens)
            if keys[:done] == prev.full_block_hashes() and upto > done:
                out[prev.request_id] = keys[done:upto]
        last[r.session_id] = r
    return out


def simulate(requests: Iterable[TraceRequest], config: SimConfig,
             progress: Callable[[int], None] | None = None) -> SimResult:
    return ClusterSim(config).run(requests, progress)
