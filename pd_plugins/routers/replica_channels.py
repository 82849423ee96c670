"""The state router replicas share (routers/replica_sync.py carries it): one channel per kind.

- PinChannel: the session table's pins (routers/sessions.py), client-named and auto-detected
  alike. An entry carries the session's decode worker, turns, resident tokens and its chain key
  (its last prompt block key), so prefix detection on another replica finds the conversation too.
  A replica adopts a peer's copy when it has more turns than its own.
- LoadChannel: each replica's own in-flight counts per worker (requests, prefill tokens, prompt
  tokens). A replica adds the sum of its peers' counts to its workers' counters, so every policy
  that reads `Worker.in_flight` and friends sees the load of all replicas without knowing about
  them; the peers' share is tracked here and replaced, never accumulated. A peer not heard from
  for `ttl_s` counts nothing (it left, or Redis is down). Only this pool's workers count, each
  peer's load on one bounded (MAX_PEER_LOAD), from at most MAX_PEERS peers at once.
- LatencyChannel: the samples of the learned latency models (prefill time over the tokens ahead,
  decode step over the batch). Each replica measures only the legs it runs; with its peers'
  samples its fit is the one a single router would have. Alone, each replica's fit stayed on the
  (pessimistic) priors for twice as many requests, and the TTFT-SLO admission rejected what one
  router admitted (bench/replicas.py on Mooncake: 18 rejected of 80 against 6).
- PrefixChannel: what the approximate prefix index learns from routing (the blocks of a prompt
  routed to a worker). Workers with KV events are left out: every replica subscribes to them.

Every pending table is bounded; past its bound the oldest changes are dropped (and counted).
Block keys agree between replicas: every process hashes token ids and text prompts alike
(pd_plugins/vocab/block_keys.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Callable, Iterable, Sequence

from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.policy.latency_model import LatencyModels
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.routers.request import MAX_SESSION_ID, short_printable_ascii
from pd_plugins.routers.sessions import Session, SessionTable
from pd_plugins.routers.workers import Worker

Load = tuple[int, int, int]  # in_flight, in_flight_prefill_tokens, in_flight_tokens
ZERO: Load = (0, 0, 0)
MAX_ITEMS = 100_000  # per channel and entry read from a peer: more is not a replica of ours
MAX_URL_CHARS = 2_048  # a worker URL a peer names; longer is no worker of any pool
MAX_URLS_PER_ITEM = 2  # the workers a prefix channel item names: a prompt's decode and prefill
MAX_PEERS = 256  # replicas whose loads count at once; a newcomer's count once one goes quiet
MAX_LOAD_ROWS = 10_000  # workers in a peer's load snapshot
# a peer's in-flight requests, prefill tokens and prompt tokens on one worker: far past any engine
MAX_PEER_LOAD: Load = (1_000_000, 10**9, 10**10)
# a peer's latency sample: tokens (or a batch size) and seconds no engine comes near
MAX_SAMPLE_X, MAX_SAMPLE_Y = 1e8, 86_400.0


def pool_url(url: object, known: Callable[[str], bool]) -> str | None:
    """The URL under which this replica's pool holds the worker a peer names, or None (none
    here). The pool strips trailing slashes (WorkerSpec, WorkerPool.get): kept as a peer spells
    it, each spelling of one worker would get a table of its own that removing the worker (by
    its own URL) never drops."""
    if not isinstance(url, str) or len(url) > MAX_URL_CHARS:
        return None
    url = url.rstrip("/")
    return url if known(url) else None


def _counts(*values: object) -> bool:
    """What a peer sends as counts: integers (not floats, strings or booleans), none negative."""
    return all(type(v) is int and v >= 0 for v in values)


class PinChannel:
    live_only = False

    def __init__(self, table: SessionTable, replica_id: str, scope: str = "",
                 max_pending: int = 10_000, known: Callable[[str], bool] = lambda url: True) -> None:
        self.name = f"pins:{scope}"
        self.table, self.max_pending = table, max_pending
        # a decode worker this replica routes to (as PrefixChannel's): a pin elsewhere is refused
        self.known = known
        table.auto_prefix = f"auto-{replica_id}-"  # automatic ids unique across replicas
        self._pending: OrderedDict[str, None] = OrderedDict()
        for event in ("replica_adopted", "replica_dropped"):
            table.counts.setdefault(event, 0)

    def recorded(self, session_id: str) -> None:
        """A turn of this session ended here (the table holds its new pin)."""
        self._pending[session_id] = None
        self._pending.move_to_end(session_id)
        self._bound()

    def take(self, now: float) -> list | None:
        items = []
        for session_id in self._pending:
            s = self.table.get(session_id)
            if s is not None and s.decode_url:
                items.append([session_id, s.decode_url, s.turns, s.resident_tokens, s.chain_key, s.auto])
        self._pending.clear()
        return items or None

    def put_back(self, items: list) -> None:
        for item in items:
            self._pending.setdefault(item[0], None)
        self._bound()

    def apply(self, origin: str, items: list, now: float) -> None:
        for session_id, decode_url, turns, resident, chain_key, auto in items[:MAX_ITEMS]:
            # an id no client could send, a decode worker not in this pool, counts that are no
            # counts: that pin is refused, the rest go on
            url = pool_url(decode_url, self.known)
            if not (isinstance(session_id, str) and short_printable_ascii(session_id, MAX_SESSION_ID)
                    and url is not None and _counts(turns, resident)
                    and (chain_key is None or type(chain_key) is int)):
                self.table.count("replica_refused")
                continue
            local = self.table.get(session_id)
            if local is None or turns > local.turns:
                self.table.adopt(session_id, Session(url, turns, resident, auto=bool(auto),
                                                     chain_key=chain_key))
                self.table.counts["replica_adopted"] += 1

    def tick(self, now: float) -> None:
        pass

    def _bound(self) -> None:
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)
            self.table.counts["replica_dropped"] += 1


class LoadChannel:
    name = "loads"
    live_only = True  # old loads say nothing about now

    def __init__(self, workers: Callable[[], Iterable[Worker]], ttl_s: float = 2.0,
                 heartbeat_s: float = 0.5) -> None:
        self.workers, self.ttl_s, self.heartbeat_s = workers, ttl_s, heartbeat_s
        self._peers: dict[str, tuple[float, dict[tuple[str, str], Load]]] = {}
        self._totals: dict[tuple[str, str], Load] = {}  # the sum of the peers' loads per worker
        self._applied: dict[Worker, Load] = {}  # the peers' share now added to each worker
        self._published: dict[tuple[str, str], Load] | None = None
        self._published_at = -math.inf

    def own(self, worker: Worker) -> Load:
        """This replica's own in-flight counts on the worker (its counters less the peers')."""
        peer = self._applied.get(worker, ZERO)
        return (worker.in_flight - peer[0], worker.in_flight_prefill_tokens - peer[1],
                worker.in_flight_tokens - peer[2])

    def peer_load(self, worker: Worker) -> Load:
        return self._applied.get(worker, ZERO)

    def take(self, now: float) -> list | None:
        snapshot = {}
        for w in self.workers():
            load = self.own(w)
            if load != ZERO:
                snapshot[(w.role, w.url)] = load
        if snapshot == self._published and (not snapshot or now - self._published_at < self.heartbeat_s):
            return None
        self._published, self._published_at = snapshot, now
        # an empty snapshot is news too ("nothing in flight here now"): one placeholder row
        return [[role, url, *load] for (role, url), load in snapshot.items()] or [["", "", 0, 0, 0]]

    def put_back(self, items: list) -> None:
        self._published = None  # publish a fresh snapshot next time

    def apply(self, origin: str, items: list, now: float) -> None:
        if origin not in self._peers and len(self._peers) >= MAX_PEERS:
            raise ValueError(f"loads of more than {MAX_PEERS} replicas")  # counted by the sync
        here = {(w.role, w.url) for w in self.workers()}
        loads = {}
        for role, url, *load in items[:MAX_LOAD_ROWS]:
            # only this pool's workers (by their own URL) and counts, each at most what one
            # replica could hold: 2**62 requests kept every request off a worker
            if (role, url) in here and len(load) >= 3 and _counts(*load[:3]):
                loads[(role, url)] = tuple(min(v, bound) for v, bound in zip(load, MAX_PEER_LOAD))
        self._forget(origin)
        self._peers[origin] = (now, loads)
        self._total(loads, +1)
        self._reapply()

    def tick(self, now: float) -> None:
        for origin in [o for o, (t, _) in self._peers.items() if now - t > self.ttl_s]:
            self._forget(origin)
        self._reapply()  # also catches workers added or removed since

    def _forget(self, origin: str) -> None:
        _, loads = self._peers.pop(origin, (0.0, {}))
        self._total(loads, -1)

    def _total(self, loads: dict[tuple[str, str], Load], sign: int) -> None:
        """The peers' sums kept as they change: a tick costs the pool's size, not the peers'."""
        for key, load in loads.items():
            total = [t + sign * v for t, v in zip(self._totals.get(key, ZERO), load)]
            if any(total):
                self._totals[key] = tuple(total)
            else:
                self._totals.pop(key, None)

    def _reapply(self) -> None:
        current = set(self.workers())
        for worker in [w for w in self._applied if w not in current]:
            self._add(worker, self._applied.pop(worker), -1)  # a removed worker: its own counts
        for worker in current:
            want = self._totals.get((worker.role, worker.url), ZERO)
            have = self._applied.get(worker, ZERO)
            if want != have:
                self._add(worker, have, -1)
                self._add(worker, want, +1)
                if want == ZERO:
                    self._applied.pop(worker, None)
                else:
                    self._applied[worker] = want

    @staticmethod
    def _add(worker: Worker, load: Sequence[int], sign: int) -> None:
        worker.in_flight += sign * load[0]
        worker.in_flight_prefill_tokens += sign * load[1]
        worker.in_flight_tokens += sign * load[2]


class _PendingItems:
    """A bounded queue of local changes to publish: the oldest are dropped (and counted) when
    full, and a batch Redis did not take goes back in front of newer ones."""

    def __init__(self, max_pending: int) -> None:
        self._pending: deque[list] = deque(maxlen=max_pending)
        self.dropped = 0

    def _add(self, item: list) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.dropped += 1
        self._pending.append(item)

    def take(self, now: float) -> list | None:
        if not self._pending:
            return None
        items = list(self._pending)
        self._pending.clear()
        return items

    def put_back(self, items: list) -> None:
        room = (self._pending.maxlen or 0) - len(self._pending)
        kept = items[-room:] if room > 0 else []
        self.dropped += len(items) - len(kept)
        self._pending.extendleft(reversed(kept))


class LatencyChannel(_PendingItems):
    # The stream's window too: a replica that starts (or comes back) begins from the cluster's
    # fit rather than the priors; the fits forget old samples exponentially anyway.
    live_only = False

    def __init__(self, models: LatencyModels, scope: str = "", max_pending: int = 2_000) -> None:
        self.name = f"latency:{scope}"
        self.fits = {"prefill": models.prefill, "decode_step": models.decode_step}
        super().__init__(max_pending)
        for name, fit in self.fits.items():
            fit.on_sample = lambda x, y, name=name: self._measured(name, x, y)

    def _measured(self, fit: str, x: float, y: float) -> None:
        self._add([fit, x, y])


    def apply(self, origin: str, items: list, now: float) -> None:
        for name, x, y in items[:MAX_ITEMS]:
            fit = self.fits.get(str(name))  # a fit this version lacks: skipped
            x, y = float(x), float(y)
            # bounded, not just finite: one 1e200 squares to inf and freezes the fit for good
            if fit is not None and 0 <= x <= MAX_SAMPLE_X and 0 <= y <= MAX_SAMPLE_Y:
                fit.learn(x, y)

    def tick(self, now: float) -> None:
        pass


class PrefixChannel(_PendingItems):
    live_only = False
    max_keys_per_take = 200_000  # about 1.8 MB of an entry: a backlog goes out over a few

    def take(self, now: float) -> list | None:
        items, keys = [], 0
        while self._pending and keys < self.max_keys_per_take:
            item = self._pending.popleft()
            items.append(item)
            keys += len(item[1])
        return items or None

    def __init__(self, index: PrefixIndex, scope: str = "", max_pending: int = 2_000,
                 max_keys: int = 8_192, known: Callable[[str], bool] = lambda url: True) -> None:
        self.name = f"prefixes:{scope}"
        self.index, self.max_keys = index, max_keys
        # a worker this replica routes to: the index keeps no table for one it does not (removed
        # here already, or never here), whatever another replica names
        self.known = known
        super().__init__(max_pending)

    def routed(self, worker_urls: Sequence[str], keys: Sequence[int]) -> None:
        """This replica routed a prompt with these block keys to these workers."""
        urls = [u for u in worker_urls if u not in self.index.exact_workers]
        if urls and keys:
            self._add([urls, list(keys[:self.max_keys])])


    def apply(self, origin: str, items: list, now: float) -> None:
        # a peer's take stops past max_keys_per_take: an entry holding more is no replica's,
        # and its small keys (a byte each) would cost the event loop seconds per 8 MB
        budget = self.max_keys_per_take + self.max_keys
        for urls, keys in items[:MAX_ITEMS]:
            if budget <= 0:
                break
            if not (isinstance(urls, list) and isinstance(keys, list)):
                continue
            keys = keys[:min(self.max_keys, budget)]
            budget -= len(keys)
            if not set(map(type, keys)) <= {int}:  # block keys are integers (checked in C)
                continue
            for url in {pool_url(url, self.known) for url in urls[:MAX_URLS_PER_ITEM]} - {None}:
                self.index.record_routed(url, keys)

    def tick(self, now: float) -> None:
        pass


class ReplicaShare:
    """What one model group's proxy tells the other replicas after a turn it served."""

    def __init__(self, pins: PinChannel | None, prefixes: PrefixChannel | None) -> None:
        self.pins, self.prefixes = pins, prefixes

    def served(self, session_id: str, info: RequestInfo, decode_url: str,
               prefill_url: str | None) -> None:
        if self.pins is not None and session_id:
            self.pins.recorded(session_id)
        if self.prefixes is not None:
            self.prefixes.routed([decode_url] if prefill_url is None else [decode_url, prefill_url],
                                 info.block_keys)
