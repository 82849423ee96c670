"""Live role changes: re-plan the P:D split from the last window of traffic, move workers, and do
not flap (`pd-planner --apply URL`; docs/planner.md, "Live role changes").

Every `interval_s` the planner predicts how each split would serve the next `window_s`: it
simulates (cluster_sim, the router's own policy) the requests in flight now with the work they
have left (the state the next window inherits: a queue left by an overload or by the previous
split; the answers in progress replay their prompts first, `lead_s`, so that the window does not
queue behind prefills already done), followed by the last `window_s` of arrivals again (the
traffic expected next; back to back until the replays cover its answers' life, `replays`, so that
the decode pool fills as it will). It scores each split by goodput: the window's requests served
within both SLOs per second, averaged over the window at its own rate and `headroom` times faster
(of two splits that serve the window, the one with room to spare: the mix moves on past the
window). It starts on
the current split and, unless that serves the window at both rates, climbs from there: both
neighbours (one instance moved either way) and the split Dynamo's rule gives for the window,
then further in the best one's direction while each step predicts more; Dynamo's split is taken
where it predicts about as much as the best found (it is sized to the window's mix, the nearest
good split sits at the edge the mix is moving past). This is cheaper than
`plan_split`'s sweep over every split and over request rates (a few simulations of one window
instead of a grid per split), and a shift from a prompt-heavy to an answer-heavy mix is met by
one move of several workers instead of one worker per interval. Hysteresis:

- a move must predict `margin` more goodput (relative) than staying, and its window must hold
  at least `min_requests` requests;
- at most one re-plan per interval, none while a move is still draining, and a move goes no
  farther than `max_step` instances;
- a move that reverses the previous one waits `min_dwell_s` after it, unless it predicts
  `reverse_margin` more or the current split misses the window at its own rate.

Applying: in the simulator, `sim_controller()` is a `SimConfig.role_controller`; against pd-router,
`RouterRoles` reads the split from `GET /admin/workers` and moves kv_both workers through
`POST /admin/workers/role` (the router drains each first), and `run_apply` reads the window from
the router's traffic record (`traffic_record:` in its config) and the requests not ended yet from
`GET /admin/in_flight` (`read_traffic`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from pd_plugins.perf.cluster_sim import SimConfig, TrafficWindow, simulate
from pd_plugins.perf.report import Slo
from pd_plugins.planner.dynamo_rule import prefill_throughput
from pd_plugins.planner.split import Split, dynamo_hint, policy_for_slo, sim_config
from pd_plugins.routers.policy.scheduler import PREFIX_SOURCE
from pd_plugins.workloads import TraceRequest

Role = Literal["prefill", "decode"]
MAX_WINDOW_REQUESTS = 20_000  # requests in one simulation (the window's newest, its replays and
# the oldest in flight): each re-plan stays a few simulations of at most this many
IN_FLIGHT_KEY_OFFSET = 1 << 60  # apart from every trace's block keys
COLLAPSE_SHARE = 0.05  # under this share of the window within the SLOs on every split: a collapse
# A move whose best split serves under this share of the window within the SLOs is judged by
# how fast it works the queue off, as in a collapse: a window of ~30 requests whose best
# split met the SLOs for 3 of them was judged by that noise, and a replay over HTTP moved back
# and forth on it (docs/benchmarks.md, "Planner over HTTP: a shift in answer length")
FEW_SERVED_SHARE = 0.15
MAX_REPLAYS = 4  # a window is simulated at most this many times back to back (replay_life)
REPLAY_KEY_OFFSET = 1 << 56  # each replay's block keys apart from the others' (no made-up reuse)


@dataclass(frozen=True)
class Hysteresis:
    margin: float = 0.05        # relative goodput gain a move must predict
    min_dwell_s: float = 120.0  # before a move may reverse the previous one
    min_requests: int = 20      # fewer in the window: too little to move on
    max_step: int | None = None  # instances one move may shift (None: as far as the climb goes)
    # a reversal within the dwell still goes ahead when it predicts this much more (relative):
    # the dwell holds back flapping on small, noisy gains, not the way out of an overload
    reverse_margin: float = 1.0

    def __post_init__(self) -> None:
        if self.margin < 0 or self.min_dwell_s < 0 or self.min_requests < 1:
            raise ValueError("hysteresis: margin and min_dwell_s must be >= 0, min_requests >= 1")
        if self.reverse_margin < 0:
            raise ValueError("hysteresis: reverse_margin must be >= 0")
        if self.max_step is not None and self.max_step < 1:
            raise ValueError("hysteresis: max_step must be >= 1 (or None)")


@dataclass
class Decision:
    at_s: float
    current: Split
    want: Split                    # == current: stay
    scores: dict[Split, float]     # predicted goodput (req/s within the SLOs) per split simulated
    reason: str

    @property
    def moves(self) -> bool:
        return self.want != self.current


@dataclass
class LivePlanner:
    """Decides, from one window of traffic, whether to move instances, which way and how many."""

    slo: Slo
    sim_base: SimConfig                     # hardware or calibration, engine limits
    policy: str = "default"
    window_s: float = 300.0
    interval_s: float = 60.0
    hysteresis: Hysteresis = field(default_factory=Hysteresis)
    # each split is also judged on the window replayed this many times faster: a split that
    # serves the window with room to spare beats one that just serves it (1: the window alone)
    headroom: float = 1.5
    peer_candidate: bool = True  # also simulate Dynamo's rule's split for the window
    replay_lead: bool = True  # the answers in progress replay their prefill ahead of the window
    # a window shorter than its answers' life is simulated back to back until the replays cover
    # that life (`replays`): else the decode pool is judged before it fills
    replay_life: bool = True
    log: list[Decision] = field(default_factory=list)
    _last_move: tuple[float, int] | None = None  # (when, +1 toward prefill / -1 toward decode)

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.interval_s > 0):
            raise ValueError("window_s and interval_s must be > 0")
        if not self.headroom >= 1:
            raise ValueError(f"headroom must be >= 1, got {self.headroom}")
        name = self.policy if isinstance(self.policy, str) else "custom"
        self._base = dataclasses.replace(
            self.sim_base, policy=policy_for_slo(self.policy, self.slo),
            prefix_source=PREFIX_SOURCE.get(name, self.sim_base.prefix_source),
            role_changes=(), role_controller=None)

    def score(self, requests: Sequence[TraceRequest], split: Split, span_s: float,
              backlog: int = 0) -> tuple[float, float]:
        """(the window's requests served within both SLOs per second of the window, requests
        finished per second until the last one ends) on `split`: goodput, and how fast the split
        works off everything; the first `backlog` requests (in flight) count only in the second."""
        config = dataclasses.replace(self._base, prefill_instances=split.prefill,
                                     decode_instances=split.decode,
                                     block_tokens=requests[0].block_tokens)
        result = simulate(requests, config)
        met = sum(1 for o in result.outcomes[backlog:]
                  if o.status == "ok" and self.slo.met(o.ttft_s, o.tpot_s))
        done = sum(1 for o in result.outcomes if o.status == "ok")
        return met / span_s, done / max(span_s, result.sim_span_s)

    def decide(self, now_s: float, window: Sequence[TraceRequest], current: Split,
               in_flight: Sequence[TraceRequest] = (),
               decoding: Sequence[TraceRequest] = ()) -> Decision:
        """`window`: the requests that arrived in the last window_s (any time origin): the
        traffic expected next. `in_flight`: the requests not ended yet (where known): the state
        each split starts from, each as the work it has left (`left_to_do`). Each split is
        simulated on the in-flight requests, all arriving at once (a queue left by an overload
        or by the previous split weighs as it will), then the window's arrivals again, at their
        own pace and `headroom` times faster; only the window counts toward goodput.
        `decoding`: the requests in flight whose prompt is prefilled (answers in progress, each
        with the tokens it still lacks): the simulator starts every request at its prefill, so
        their prompts are replayed ahead of the window (`lead_s`), and the window starts once
        they hold their KV where they decode, as they do now."""
        def stay(reason: str, scores: dict | None = None) -> Decision:
            d = Decision(now_s, current, current, scores or {}, reason)
            self.log.append(d)
            return d

        if len(window) < self.hysteresis.min_requests:
            return stay(f"{len(window)} requests in the window (< {self.hysteresis.min_requests})")
        window = rebased(window[-MAX_WINDOW_REQUESTS:])
        span = max(self.window_s, window[-1].arrival_s)
        rate = len(window) / span
        # the most replays of the window a simulation takes (at the headroom's pace: `replays`),
        # and the oldest in flight, at most as many requests as those replays hold (an answer's
        # life of them): enough to tell which split works a queue off, all within the bound
        most = min(self.replays(window, span / self.headroom),
                   max(1, MAX_WINDOW_REQUESTS // (2 * len(window))))
        keep = min(most * len(window), MAX_WINDOW_REQUESTS - most * len(window))
        tagged = sorted([(r, False) for r in in_flight] + [(r, True) for r in decoding],
                        key=lambda t: t[0].arrival_s)[:max(0, keep)]
        # their own copies: a request in flight and in the window must not find its prompt
        # cached by itself
        queue = [(dataclasses.replace(r, request_id=i, arrival_s=0.0, session_id=None,
                                      block_hashes=tuple(h + IN_FLIGHT_KEY_OFFSET
                                                         for h in r.block_hashes)), answering)
                 for i, (r, answering) in enumerate(tagged)]
        sims: dict[tuple[Split, float], tuple[float, float]] = {}

        def requests_for(split: Split, pace: float, replays: int) -> list[TraceRequest]:
            lead = self.lead_s([r for r, answering in queue if answering], split)
            tpot = self.slo.tpot_s
            return ([r if not answering else
                     dataclasses.replace(r, output_tokens=r.output_tokens + int(lead / tpot))
                     for r, answering in queue if answering]
                    + [dataclasses.replace(r, arrival_s=lead) for r, answering in queue
                       if not answering]
                    + [dataclasses.replace(
                           r, request_id=len(queue) + k * len(window) + r.request_id,
                           arrival_s=lead + (k * span + r.arrival_s) / pace,
                           block_hashes=tuple(h + k * REPLAY_KEY_OFFSET for h in r.block_hashes)
                           if k else r.block_hashes)
                       for k in range(replays) for r in window])

        def run(split: Split, pace: float = 1.0) -> tuple[float, float]:
            """(goodput, work-off rate) at `pace` x the window's rate, in req/s of the window."""
            if (split, pace) not in sims:
                replays = min(self.replays(window, span / pace), most)
                g, w = self.score(requests_for(split, pace, replays), split,
                                  replays * span / pace, len(queue))
                sims[split, pace] = (g / pace, w)
            return sims[split, pace]

        def value(split: Split) -> float:
            """The goodput at the window's rate and at `headroom` x it, averaged: among splits
            that serve the window, the one with room to spare (the mix moves on past the window)."""
            return (run(split)[0] + run(split, self.headroom)[0]) / 2

        gain = 1 + self.hysteresis.margin
        if run(current)[0] * gain >= rate and run(current, self.headroom)[0] * gain >= rate:
            # no split can serve more than every request, at either rate: none could gain
            return stay("the current split serves (nearly) the whole window within the SLOs, "
                        f"at {self.headroom:g}x its rate too", {s: value(s) for s, _ in sims})
        best, score = self._climb(current, run, value, rate, self._peer_split(window, current))
        if score is value and best != current and run(best)[0] < FEW_SERVED_SHARE * rate:
            score = self._work_off(run)  # too few served within the SLOs to tell the splits apart
        scores = {s: value(s) for s, pace in sims if pace == 1.0 and (s, self.headroom) in sims}
        scores |= {s: run(s)[0] for s, pace in sims if s not in scores}
        if best == current or score(best) <= score(current) * gain + 1e-12:
            return stay("no other split gains the margin", scores)
        direction = 1 if best.prefill > current.prefill else -1
        # the dwell holds back flapping between splits that both serve the window; a split that
        # misses the window at its own rate is a mistake to correct, not a choice to keep
        failing = run(current)[0] * gain < rate
        if (self._last_move is not None and self._last_move[1] != direction and not failing
                and now_s - self._last_move[0] < self.hysteresis.min_dwell_s
                and score(best) <= score(current) * (1 + self.hysteresis.reverse_margin) + 1e-12):
            return stay(f"would reverse the move at {self._last_move[0]:.0f} s (dwell)", scores)
        self._last_move = (now_s, direction)
        worked_off = score is not value
        d = Decision(now_s, current, best, scores,
                     f"{best} predicts {score(best):.3g} req/s "
                     f"{'worked off' if worked_off else 'within SLO'} vs {score(current):.3g}")
        self.log.append(d)
        return d

    def replays(self, window: Sequence[TraceRequest], span_s: float) -> int:
        """How many times the window, replayed in `span_s` (its span over the pace simulated),
        is simulated back to back: enough to cover the life of its mean answer at the TPOT SLO
        (`replay_life`), at most MAX_REPLAYS. A decode pool holds each answer's KV and batch slot
        for that long; simulated once from the in-flight requests, a window shorter than that
        never fills it, and the planner then saw room where there was none: on the Mooncake
        requests with long answers (bench/planner_phase.py: 560 tokens on average, a mean life of
        28 s at 50 ms, in 15 s windows) it moved 4P:4D to 5P:3D after the first window and served
        half the requests 4P:4D serves. Every replay counts toward goodput. Each replay's prompts
        are keyed apart, so that none finds another's in a cache: reuse across windows (a shared
        system prompt) is not credited to the replays after the first."""
        if not self.replay_life:
            return 1
        life = self.slo.tpot_s * sum(r.output_tokens for r in window) / len(window)
        return max(1, min(MAX_REPLAYS, 1 + int(life // span_s)))

    def lead_s(self, decoding: Sequence[TraceRequest], split: Split) -> float:
        """How long `split`'s prefill pool takes to replay the prompts of the answers in
        progress (at the engine profile's throughput for their mean prompt): the window's
        arrivals start after it, so that they queue behind the work that is really there (the
        answers, holding their KV on the decode pool) and not behind prefills done already.
        Charged at the window's start instead, those prefills (300-odd chat prompts in the
        chat phase of bench/planner.py) delayed the window by seconds on a small prefill pool
        and the planner held 3P:5D where 2P:6D served the phase."""
        if not decoding or not self.replay_lead:
            return 0.0
        tokens = sum(r.input_tokens for r in decoding)
        tps = prefill_throughput(self._base.hardware, tokens / len(decoding))
        return min(self.window_s, tokens / split.prefill / tps)

    def _peer_split(self, window: Sequence[TraceRequest], current: Split) -> Split | None:
        """Dynamo's rule's split for the window (dynamo_rule.py), a candidate beside the climb's
        neighbours: where the mix has shifted far, it points past them at once."""
        if not self.peer_candidate:
            return None
        return dynamo_hint(window, self._base, self.slo, current.instances)

    @staticmethod
    def _work_off(run: Callable[[Split], tuple[float, float]]) -> Callable[[Split], float]:
        """The score of a split in a collapse: how fast it works the queue off."""
        return lambda s: run(s)[1]

    def _climb(self, current: Split, run: Callable[[Split], tuple[float, float]],
               value: Callable[[Split], float], arrival_rate: float, peer: Split | None
               ) -> tuple[Split, Callable[[Split], float]]:
        """(the best split found, the score it was chosen by: `value`, or the work-off rate in
        a collapse). Both neighbours and the peer rule's split first, then on in the best one's
        direction while each step predicts the margin more (goodput over the split is taken as
        single-peaked: the climb stops at the peak, or where it flattens)."""
        n = current.instances
        step_limit = self.hysteresis.max_step or n

        def at(p: int) -> Split | None:
            ok = 1 <= p <= n - 1 and abs(p - current.prefill) <= step_limit
            return Split(p, n - p) if ok else None

        tried = [current, *(s for s in (at(current.prefill + 1), at(current.prefill - 1)) if s)]
        rule = None
        if peer is not None and peer != current:
            # as far toward it as one move may go
            toward = max(-step_limit, min(step_limit, peer.prefill - current.prefill))
            rule = at(current.prefill + toward)
            if rule is not None and rule not in tried:
                tried.append(rule)
        # In a collapse (a queue no split clears within the window) hardly any request meets the
        # SLOs on any split: then the split that works the queue off sooner is better.
        collapsed = max(run(s)[0] for s in tried) < COLLAPSE_SHARE * arrival_rate
        score = self._work_off(run) if collapsed else value
        best = max(tried, key=lambda s: (score(s), s == current))
        if best == current:
            return current, score
        direction = 1 if best.prefill > current.prefill else -1
        # each further instance moved must predict the margin more too: among splits that
        # serve the window about as well, the nearest keeps the most room for a shift back
        gain = 1 + self.hysteresis.margin
        while ((nxt := at(best.prefill + direction)) is not None
               and score(nxt) > score(best) * gain + 1e-12):
            best = nxt
        # The peer rule's split, where the simulation finds it about as good as the best (and
        # better than staying): it is sized to the window's mix, so it keeps room both ways,
        # where the nearest good split sits at the edge the mix is moving past.
        if (rule is not None and rule != best and score(rule) * gain + 1e-12 >= score(best)
                and score(rule) > score(current) * gain + 1e-12):
            best = rule
        return best, score

    def sim_controller(self) -> Callable[[TrafficWindow], tuple[int, int] | None]:
        """A `SimConfig.role_controller`: it keeps the last window_s of arrivals itself (the
        simulator hands it one control interval at a time) and passes the requests in flight
        with the work they have left; run with control_interval_s = interval_s."""
        recent: deque[TraceRequest] = deque()
        unfinished: dict[int, TraceRequest] = {}
        tpot = RecentTpot(self.slo.tpot_s)

        def control(window: TrafficWindow) -> tuple[int, int] | None:
            recent.extend(window.arrivals)
            unfinished.update((r.request_id, r) for r in window.arrivals)
            for o in window.ended:
                unfinished.pop(o.request_id, None)
            tpot.observe(window.ended)
            while recent and recent[0].arrival_s < window.end_s - self.window_s:
                recent.popleft()
            if window.moving:  # a move still draining: the split is not settled yet
                return None
            mine = [o for o in window.in_flight if o.request_id in unfinished]
            waiting = [unfinished[o.request_id] for o in mine if o.ttft_s is None]
            decoding = [left_to_do(unfinished[o.request_id], o, window.end_s, tpot.value)
                        for o in mine if o.ttft_s is not None]
            d = self.decide(window.end_s, list(recent), Split(window.prefill, window.decode),
                            waiting, decoding)
            return (d.want.prefill, d.want.decode) if d.moves else None

        return control


@dataclass
class RecentTpot:
    """The mean time per output token of the requests that ended in the last interval (the
    last known value when none did): how fast the answers in flight are coming."""

    value: float

    def observe(self, ended: Sequence) -> None:
        seen = [o.tpot_s for o in ended if o.status == "ok" and o.tpot_s]
        if seen:
            self.value = sum(seen) / len(seen)


def left_to_do(request: TraceRequest, outcome, now_s: float, tpot_s: float) -> TraceRequest:
    """A request in flight as the work it has left: all of it until its first token; after
    that, the tokens its answer still lacks at `tpot_s` each (its prompt stays, to be cached
    where it decodes: the KV it holds). The simulator starts every request at its prefill, so
    the prompt is charged to the prefill pool again; leaving it out instead (a prompt of one
    token) left out the KV the answer holds with it, and the planner then saw room in a decode
    pool that had none: in bench/planner.py at 1.1x the nominal rate it stayed at 3P:5D through
    the chat phase and served 0.37 of the requests (0.92 charging the prompt again)."""
    if outcome.ttft_s is None:
        return request
    produced = 1 + int((now_s - outcome.arrival_s - outcome.ttft_s) / max(tpot_s, 1e-6))
    return dataclasses.replace(request, output_tokens=max(1, request.output_tokens - produced))


def rebased(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The requests with arrivals from 0 and ids 0.. (what the simulator replays)."""
    t0 = requests[0].arrival_s
    return [dataclasses.replace(r, request_id=i, arrival_s=r.arrival_s - t0)
            for i, r in enumerate(requests)]


# -- against pd-router -----------------------------------------------------------------------

class AdminError(RuntimeError):
    """The router's admin API answered an error (its status and reason in the message)."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: urllib would resend the admin token to wherever it points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102
        return None


_ADMIN_OPENER = urllib.request.build_opener(_NoRedirects)


@dataclass
class RouterRoles:
    """The router's P:D split and its role changes, through the admin API."""

    url: str
    token: str | None
    model: str | None = None
    drain_timeout_s: float = 60.0
    timeout_s: float = 10.0

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None
              ) -> dict:
        req = urllib.request.Request(self.url.rstrip("/") + path, method=method,
                                     data=None if body is None else json.dumps(body).encode())
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with _ADMIN_OPENER.open(req, timeout=timeout or self.timeout_s) as resp:
                return json.loads(resp.read(1 << 24))
        except urllib.error.HTTPError as e:
            raise AdminError(f"{method} {path}: {e.code} {e.read(4096).decode(errors='replace')}") from e
        except (urllib.error.URLError, TimeoutError, ValueError) as e:
            raise AdminError(f"{method} {path}: {e}") from e

    def workers(self) -> list[dict]:
        workers = self._call("GET", "/admin/workers")["workers"]
        return [w for w in workers if self.model is None or w.get("model", "") == self.model]

    def split(self) -> tuple[Split, bool]:
        """(split with moves in progress counted at their destination, a move in progress)."""
        counts = {"prefill": 0, "decode": 0}
        moving = False
        for w in self.workers():
            if not w.get("healthy", True):
                continue
            moving |= bool(w.get("moving_to"))
            counts[w.get("moving_to") or w["role"]] += 1
        return Split(counts["prefill"], counts["decode"]), moving

    def in_flight(self, limit: int = 5000) -> dict:
        """GET /admin/in_flight: the oldest `limit` requests not ended yet (the router lists at
        most 5000: a queue longer than that is a collapse), on the record's clock (`now`, each
        request's `t`), of this model (or all)."""
        query = f"?limit={limit}" + (f"&model={urllib.parse.quote(self.model)}" if self.model else "")
        return self._call("GET", "/admin/in_flight" + query)

    def move_one(self, to: Role) -> dict:
        """Move the healthy kv_both worker of the other role holding the fewest requests."""
        source = "decode" if to == "prefill" else "prefill"
        movable = sorted((w for w in self.workers() if w["role"] == source and w.get("kv_both")
                          and w.get("healthy", True) and not w.get("moving_to")),
                         key=lambda w: (w.get("in_flight", 0), w["url"]))
        if not movable:
            raise AdminError(f"no healthy kv_both {source} worker to move to {to}")
        body = {"url": movable[0]["url"], "to": to, "drain_timeout_s": self.drain_timeout_s}
        if self.model is not None:
            body["model"] = self.model
        # the router answers once the worker serves its new role: after the drain
        return self._call("POST", "/admin/workers/role", body, timeout=self.drain_timeout_s + 30)


def window_from_record(path: str, window_s: float, model: str | None,
                       now: float | None = None) -> list[TraceRequest]:
    """The requests of the router's traffic record (and its rotated files) that arrived in the
    `window_s` before `now` (unix s; default: this host's clock), arrivals on the record's clock.
    Records are written as requests end: those still running are not here (`read_traffic`)."""
    from pd_plugins.workloads.traffic_record import requests_of_records

    now = time.time() if now is None else now
    return requests_of_records(_records_in_window(path, window_s, model, now), origin=0.0)


def _records_in_window(path: str, window_s: float, model: str | None, now: float) -> list[dict]:
    from pd_plugins.workloads.traffic_record import read_records, rotated_paths

    if not os.path.exists(path) or now - os.path.getmtime(path) > window_s:
        return []  # not written for a whole window: no request that arrived in it has ended
    # a rotated file last written before the window began holds no arrival in it
    files = [f for f in rotated_paths(path) if os.path.getmtime(f) >= now - window_s]
    return [r for r in read_records(files, model) if now - window_s <= r["t"] <= now]


@dataclass
class RouterTraffic:
    """What `--apply` plans from, on the router's clock (unix s): as the simulator's controller
    sees it (`sim_controller`)."""

    now_s: float
    window: list[TraceRequest]     # arrived in the last window_s: ended (the record) or not
    in_flight: list[TraceRequest]  # not ended (GET /admin/in_flight), prompt not prefilled yet
    # not ended, prompt prefilled: answers in progress, as the tokens each still lacks
    decoding: list[TraceRequest] = field(default_factory=list)


def read_traffic(roles: RouterRoles, record: str, window_s: float,
                 model: str | None = None) -> RouterTraffic:
    """The window's arrivals, from the traffic record (requests that ended) and the router's
    list of requests in flight (those that did not), and the requests in flight as the work they
    have left, as `left_to_do` in the simulator: all of it until its prompt is prefilled, then
    its prompt (the KV it holds) and the tokens its answer still lacks (the router counts those
    relayed). An answer's length is its `max_tokens` (exact for clients that set it to the answer,
    an upper bound otherwise); without one, the median answer of the window's ended requests."""
    from pd_plugins.workloads.traffic_record import requests_of_records

    listing = roles.in_flight()  # first: a request that ends meanwhile is then in both, once
    now = float(listing["now"])
    ended = _records_in_window(record, window_s, model, now)
    seen = {(r["t"], r["input_tokens"]) for r in ended}
    running = [e for e in listing["requests"] if (e["t"], e["input_tokens"]) not in seen]
    answers = sorted(r["output_tokens"] for r in ended) or [1]
    typical = answers[len(answers) // 2]
    rows = ended + [{**e, "output_tokens": max(e["max_tokens"] or typical, e["output_tokens"] + 1),
                     "produced": e["output_tokens"] if e["phase"] in ("decode", "answer") else None}
                    for e in running]
    rows.sort(key=lambda r: r["t"])  # requests_of_records keeps this order (a stable sort)
    requests = requests_of_records(rows, origin=0.0)
    window = [r for r, row in zip(requests, rows) if row["t"] >= now - window_s]
    in_flight = [r for r, row in zip(requests, rows) if row.get("produced", 0) is None]
    decoding = [dataclasses.replace(r, output_tokens=max(1, r.output_tokens - row["produced"]))
                for r, row in zip(requests, rows) if row.get("produced") is not None]
    return RouterTraffic(now, window, in_flight, decoding)


def apply_once(planner: LivePlanner, roles: RouterRoles, window: Sequence[TraceRequest],
               now_s: float, dry_run: bool = False, say: Callable[[str], None] = print,
               in_flight: Sequence[TraceRequest] = (),
               decoding: Sequence[TraceRequest] = ()) -> Decision | None:
    """One re-plan against the router: decide (on `read_traffic`'s window and requests in
    flight, not prefilled and answering), and move workers one at a time if it says so."""
    split, moving = roles.split()
    if moving:
        say("a move is in progress: not re-planning")
        return None
    if split.prefill < 1 or split.decode < 1:
        say(f"router split {split}: nothing to plan (both pools need a worker)")
        return None
    decision = planner.decide(now_s, window, split, in_flight, decoding)
    scores = ", ".join(f"{s}: {v:.3g}" for s, v in sorted(decision.scores.items()))
    say(f"split {split}, {len(window)} requests in the window, "
        f"{len(in_flight) + len(decoding)} in flight ({len(decoding)} answering): "
        f"{'move to ' + str(decision.want) if decision.moves else 'stay'} ({decision.reason})"
        + (f" [{scores}]" if scores else ""))
    if decision.moves and not dry_run:
        to: Role = "prefill" if decision.want.prefill > split.prefill else "decode"
        for _ in range(abs(decision.want.prefill - split.prefill)):  # one worker, drained, at a time
            moved = roles.move_one(to)
            say(f"moved {moved.get('moved')} from {moved.get('from')} to {moved.get('to')} "
                f"({moved.get('drained')} requests drained)")
    return decision


# -- the command line (pd-planner --apply URL; cli.py calls these) ---------------------------

def add_apply_arguments(parser: argparse.ArgumentParser) -> None:
    """The --apply flags (those the parser lacks: pd-planner already has --model)."""
    flags = {s for a in parser._actions for s in a.option_strings}
    g = parser.add_argument_group("live role changes (--apply; docs/planner.md)")
    for flag, kw in (
        ("--apply", dict(metavar="URL", help="re-plan every --interval-s from --record and the "
                                             "requests in flight (GET URL/admin/in_flight), and "
                                             "move kv_both workers of the router at URL")),
        ("--admin-token", dict(help="the router's admin token (default $PD_ROUTER_ADMIN_TOKEN)")),
        ("--interval-s", dict(type=float, default=60.0, help="re-plan every S seconds (60)")),
        ("--window-s", dict(type=float, default=300.0, help="from the last S seconds of traffic (300)")),
        ("--margin", dict(type=float, default=0.05,
                          help="relative goodput gain a move must predict (0.05)")),
        ("--min-dwell-s", dict(type=float, default=120.0,
                               help="before a move may reverse the previous one (120)")),
        ("--reverse-margin", dict(type=float, default=1.0,
                                  help="relative gain that lets a reversal through the dwell (1.0)")),
        ("--max-step", dict(type=int, default=None,
                            help="workers one move may shift (default: as far as the climb goes)")),
        ("--drain-timeout-s", dict(type=float, default=60.0, help="the router's drain bound (60)")),
        ("--once", dict(action="store_true", help="re-plan once, then exit")),
        ("--dry-run", dict(action="store_true", help="print the decisions, move nothing")),
        ("--model", dict(help="the model group to plan")),
    ):
        if flag not in flags:
            g.add_argument(flag, **kw)


def engine_config(args: argparse.Namespace) -> SimConfig:
    """The simulated engines: the router's calibration, else a hardware preset (as cli.py)."""
    return sim_config(hardware=args.hardware, calibration=getattr(args, "calibration", None),
                      model=args.model, kv_capacity_tokens=args.kv_capacity_tokens,
                      host_kv_gb=getattr(args, "host_kv_gb", 0.0))


def run_apply(args: argparse.Namespace) -> int:
    if not getattr(args, "record", None):
        print("pd-planner: --apply needs --record (the router's traffic_record path)", file=sys.stderr)
        return 2
    token = args.admin_token or os.environ.get("PD_ROUTER_ADMIN_TOKEN")
    try:
        planner = LivePlanner(Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3),
                              engine_config(args), policy=args.policy,
                              window_s=args.window_s, interval_s=args.interval_s,
                              hysteresis=Hysteresis(args.margin, args.min_dwell_s,
                                                    max_step=args.max_step,
                                                    reverse_margin=args.reverse_margin))
    except (OSError, ValueError) as e:
        print(f"pd-planner: {e}", file=sys.stderr)
        return 2
    roles = RouterRoles(args.apply, token, args.model, args.drain_timeout_s)
    say = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    try:
        while True:
            started = time.monotonic()
            try:
                traffic = read_traffic(roles, args.record, args.window_s, args.model)
                apply_once(planner, roles, traffic.window, traffic.now_s, args.dry_run, say,
                           traffic.in_flight, traffic.decoding)
            except (AdminError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                # KeyError, TypeError, AttributeError: an answer of the wrong shape (not a
                # router, or another version): this interval is lost, not the planner
                say(f"this interval failed: {type(e).__name__}: {e}")
                if args.once:
                    return 1
            if args.once:
                return 0
            time.sleep(max(0.0, args.interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 0
