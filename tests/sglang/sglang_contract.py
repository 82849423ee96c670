"""SGLang's own scheduler-side queue code over pd-plugins' KV manager, sender and receiver (the
`contract` role of tests/sglang/sglang_roles.py; runs in .venv-sglang; the assertions are in
tests/sglang/test_sglang_contract.py).

tests/sglang/sglang_roles.py drives our classes the way SGLang's queues do; this module runs
SGLang's queues themselves: the real `PrefillBootstrapQueue._init_kv_manager` and
`DecodePreallocQueue._init_kv_manager` build our managers (over a real CPU MHATokenToKVPool and
MetadataBuffers, with the KVArgs SGLang fills: `system_dp_rank` None without a DP controller), and
the real `DecodePreallocQueue.add`, `_resolve_pending_reqs`, `prefetch_prefill_dp_rank_queries`,
`_update_handshake_waiters` (poll and all-reduce over a one-process gloo group),
`_submit_prefill_recompute` and `PrefillBootstrapQueue.create_sender` / `pop_bootstrapped` run on
real `Req`s. The queues themselves are made with `object.__new__` and given only the attributes
these methods read; the scheduler, the token allocator and the metadata-index allocator are
stand-ins (`StandIn*` below, named as such): the KV pool, the metadata buffers, the requests,
the runtime config (SGLang's `override_server_args` test hook) and the registry are real.

It also scans SGLang's queue code (AST) for every attribute read on a kv_manager, kv_receiver or
sender, and checks each exists on our objects (`attribute_contract`).

One JSON line per event (name in "event"); a step that raises reports its exception instead.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import traceback
import types
from array import array
from pathlib import Path

import torch

from tests.sglang.sglang_roles import emit

BACKENDS = ("pd-shm", "pd-nixl")
PAGE_SIZE, LAYERS, HEADS, DIM = 4, 2, 2, 8

# Where SGLang's scheduler side touches a transfer backend's objects: file -> the functions read
# (None: the whole file). utils.py: only its poll helpers (the rest are SGLang's own backends'
# helpers, which never run for ours).
SCANNED = {
    "disaggregation/decode.py": None,
    "disaggregation/prefill.py": None,
    "disaggregation/decode_hicache_mixin.py": None,
    "disaggregation/decode_schedule_batch_mixin.py": None,
    "disaggregation/role_switch.py": None,
    "managers/scheduler.py": None,
    "managers/scheduler_pp_mixin.py": None,
    "disaggregation/utils.py": {"poll_and_all_reduce", "poll_and_all_reduce_attn_cp_tp_group",
                                "poll_and_all_reduce_with_staging",
                                "poll_and_all_reduce_prefill_pp", "poll_and_all_reduce_pp"},
}
# the name an expression ends with -> which of our objects it is
OBJECT_NAMES = {"kv_manager": "manager", "kv_mgr": "manager", "km": "manager",
                "kv_receiver": "receiver", "disagg_kv_sender": "sender", "sender": "sender"}
# read by SGLang but absent on ours, each on a path ours never takes (the reason); the test
# also checks that SGLang still reads each (a stale entry is an error)
EXEMPT = {
    ("manager", "clear_deferred_abort_state"):
        "deferred KV release only (enable_deferred_decode_kv_release is False on ours)",
    ("manager", "is_abort_release_safe"):
        "deferred KV release only (enable_deferred_decode_kv_release is False on ours)",
    ("receiver", "ensure_abort_notified"):
        "deferred KV release only (enable_deferred_decode_kv_release is False on ours)",
    ("receiver", "bootstrap_infos"): "read only when abort_notified is True (never on ours)",
    ("manager", "enable_all_cp_ranks_for_transfer"):
        "read only for a sender with supports_host_tensor_indices (ours has none)",
    ("manager", "transfer_infos"):
        "read only after the manager's _prefetch_staging_reqs (ours has none; no staging)",
}
# every poller's poll() is called through lists (poll_and_all_reduce*), never by name
IMPLICIT = {("receiver", "poll"), ("sender", "poll")}


def sglang_root() -> Path:
    return Path(importlib.util.find_spec("sglang.srt").submodule_search_locations[0])


def _tail(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _guards(function) -> set[tuple[str, str]]:
    """(object, attribute) pairs a function tests with hasattr / getattr(obj, "name", ...)."""
    return {(OBJECT_NAMES[_tail(node.args[0])], node.args[1].value)
            for node in ast.walk(function)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and OBJECT_NAMES.get(_tail(node.args[0]))}


def scan_upstream() -> dict:
    """{(object, attribute): [file:line, ...]} of every attribute SGLang reads on one of our
    objects, leaving out reads in a function that also tests that attribute with hasattr /
    getattr (SGLang's own guard for backends without it)."""
    reads: dict[tuple[str, str], list[str]] = {}
    root = sglang_root()

    def visit(node, rel: str, guarded: frozenset) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            guarded = guarded | _guards(node)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            kind = OBJECT_NAMES.get(_tail(node.value))
            if kind and (kind, node.attr) not in guarded:
                reads.setdefault((kind, node.attr), []).append(f"{rel}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, rel, guarded)

    for rel, functions in SCANNED.items():
        tree = ast.parse((root / rel).read_text())
        scopes = [tree] if functions is None else [
            node for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name in functions]
        if functions is not None and len(scopes) != len(functions):
            raise RuntimeError(f"{rel}: expected functions {sorted(functions)}, found "
                               f"{sorted(n.name for n in scopes)}")
        for scope in scopes:
            visit(scope, rel, frozenset())
    return reads


def server_args(mode: str, port: int, backend: str, *extra: str):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args([
        "--model-path", "unused", "--device", "cpu", "--host", "127.0.0.1",
        "--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend,
        "--disaggregation-bootstrap-port", str(port), *extra]))


class StandInScheduler(types.SimpleNamespace):
    """Stand-in for SGLang's Scheduler: only what the queue methods driven here read."""


class StandInModelConfig(types.SimpleNamespace):
    """Stand-in for SGLang's ModelConfig: the layer and KV-head counts of the pool below."""

    def get_total_num_kv_heads(self) -> int:
        return HEADS


class StandInAllocator(types.SimpleNamespace):
    """Stand-in for the token-to-KV-pool allocator: page size, and no capacity limit."""

    def prealloc_ceiling_fits(self, full_tokens, swa_tokens):
        return None  # no unified byte budget: SGLang then compares with max_total_num_tokens


class StandInIndexAllocator:
    """Stand-in for the metadata-buffer index allocator."""

    def __init__(self, size: int = 16) -> None:
        self.free = list(range(size))

    def available_size(self) -> int:
        return len(self.free)

    def alloc(self) -> int:
        return self.free.pop(0)


def engine_memory():
    """A real CPU KV pool and real metadata buffers, as SGLang's scheduler allocates them."""
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=64 * PAGE_SIZE, page_size=PAGE_SIZE, dtype=torch.float32,
                            head_num=HEADS, head_dim=DIM, layer_num=LAYERS, device="cpu",
                            enable_memory_saver=False, enable_alt_stream=False)
    meta = MetadataBuffers(16, hidden_size=DIM, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=1)
    return pool, meta


def build_manager(mode: str, backend: str, port: int, dp_rank: int | None = None, *extra: str):
    """Our manager, built by SGLang's own PrefillBootstrapQueue / DecodePreallocQueue
    ._init_kv_manager (which fills KVArgs from the pool, the metadata buffers and the runtime
    config), on a queue holding only what that method reads."""
    from sglang.srt import runtime_context
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import TransferBackend

    runtime_context.get_parallel().override_permanently(tp_rank=0, pp_rank=0, dp_rank=dp_rank)
    pool, meta = engine_memory()
    scheduler = StandInScheduler(
        tp_worker=types.SimpleNamespace(
            model_runner=types.SimpleNamespace(kv_cache_dtype_str="float32")),
        rust_server=None, enable_hisparse=False,
        model_config=StandInModelConfig(num_hidden_layers=LAYERS, hf_text_config=None),
        server_args=server_args(mode, port, backend, *extra))
    cls = PrefillBootstrapQueue if mode == "prefill" else DecodePreallocQueue
    queue = object.__new__(cls)
    queue.__dict__.update(transfer_backend=TransferBackend(backend), tp_rank=0, pp_rank=0,
                          token_to_kv_pool=pool, draft_token_to_kv_pool=None, scheduler=scheduler,
                          metadata_buffers=meta, is_mla_backend=False, enable_staging=False)
    manager = queue._init_kv_manager()
    manager._test_memory = (pool, meta)  # keep the buffers the manager points into alive
    return manager


def gloo_group():
    """A one-process gloo group: SGLang's poll helpers all-reduce poll states over one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from pd_plugins.testing.processes import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    return dist.group.WORLD


def request(rid: str, room: int, port: int, host: str = "127.0.0.1", prefill_dp_rank=None):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", range(1, 10)), SamplingParams(max_new_tokens=4),
              bootstrap_host=host, bootstrap_port=port, bootstrap_room=room,
              disagg_prefill_dp_rank=prefill_dp_rank)
    return req


def decode_queue(manager, backend: str):
    """SGLang's DecodePreallocQueue with only what add(), the DP-rank resolution and the
    handshake poll read (the rest of its __init__ needs a model runner)."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import TransferBackend

    queue = object.__new__(DecodePreallocQueue)
    queue.__dict__.update(
        kv_manager=manager, transfer_backend=TransferBackend(backend), queue=[], pending_reqs=[],
        retracted_queue=[], _prefill_dp_rank_queries={}, _ensure_retry_count={},
        _max_ensure_retries=15, _ensure_last_attempt_time={}, _ensure_retry_interval=1.0,
        token_to_kv_pool_allocator=StandInAllocator(page_size=PAGE_SIZE),
        token_to_kv_pool=object(),  # not an SWA / DeepSeek-V4 pool
        scheduler=StandInScheduler(enable_hisparse=False,
                                   metrics_reporter=types.SimpleNamespace(enable_metrics=False)),
        max_total_num_tokens=1 << 20, num_reserved_decode_tokens=0, pp_size=1, tp_rank=0,
        gloo_group=gloo_group())
    return queue


def receiver_view(decode_req) -> dict:
    receiver = decode_req.kv_receiver
    failure = ""
    if receiver.state == 0:
        try:
            receiver.failure_exception()
        except Exception as exc:  # noqa: BLE001 - the reason is what the test reads
            failure = f"{type(exc).__name__}: {exc}"
    return {"class": type(receiver).__name__, "state": receiver.state,
            "initialised": receiver.initialised, "prefill_rank": receiver.prefill_rank_key,
            "waiting_for_input": decode_req.waiting_for_input, "failure": failure}


def step(name: str, fn, **context) -> None:
    """Run one step; its event carries what it returned, or the exception it raised."""
    try:
        emit(event=name, **context, **fn())
    except Exception as exc:  # noqa: BLE001 - a failing step is what the test reports
        emit(event=name, **context, error=f"{type(exc).__name__}: {exc}",
             traceback=traceback.format_exc()[-3000:])


def registry_port(backend: str, objects: dict) -> int:
    """A free port with a bootstrap registry (ours, through SGLang's get_kv_class) on it."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from pd_plugins.testing.processes import free_port

    port = free_port()
    objects["registries"].append(get_kv_class(TransferBackend(backend),
                                              KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port))
    return port


def decode_queue_steps(backend: str, objects: dict) -> dict:
    """A TP 1 prefill of one DP rank: SGLang's decode queue routes rooms to it."""
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, get_kv_class
    from sglang.srt.disaggregation.utils import TransferBackend

    from pd_plugins.testing.processes import free_port

    port = registry_port(backend, objects)
    prefill = build_manager("prefill", backend, port)
    decode = build_manager("decode", backend, port)
    objects["managers"] += [prefill, decode]
    found = {"prefill_rank_key": prefill.rank_key, "decode_rank_key": decode.rank_key,
             "decode_mode": decode.mode == DisaggregationMode.DECODE}
    queue = decode_queue(decode, backend)
    first = request("first", 7, port)
    queue.add(first)  # nothing known of the prefill yet: the slow path
    found["first_add"] = {"queued": len(queue.queue), "pending": len(queue.pending_reqs),
                          **receiver_view(queue.queue[0])}
    queue.prefetch_prefill_dp_rank_queries()  # no parallel info yet: nothing to prefetch
    queue._resolve_pending_reqs()  # try_ensure_parallel_info, then init(dp rank)
    info = decode.prefill_info_table.get(f"127.0.0.1:{port}")
    found["resolved"] = {"pending": len(queue.pending_reqs), **receiver_view(queue.queue[0]),
                         "info": info and {"dp_size": info.dp_size, "attn_tp_size":
                                           info.attn_tp_size,
                                           "follow_bootstrap_room": info.follow_bootstrap_room}}
    queue.add(request("second", 8, port))  # the fast path: the table has the prefill now
    found["second_add"] = {"pending": len(queue.pending_reqs), **receiver_view(queue.queue[1])}
    queue._update_handshake_waiters()  # SGLang's poll and all-reduce over the gloo group
    found["handshake"] = [receiver_view(r) for r in queue.queue]
    objects["receivers"] += [r.kv_receiver for r in queue.queue]

    # a prefill nobody registered: pending, never bootstrapped before init; SGLang's abort
    # after its retries names why
    nowhere = free_port()
    queue.add(request("nowhere", 9, nowhere))
    queue._resolve_pending_reqs()
    lost = queue.queue[-1]
    lost.kv_receiver.poll()
    found["unregistered"] = {"pending": len(queue.pending_reqs), **receiver_view(lost)}
    lost.kv_receiver.abort()
    found["unregistered_aborted"] = receiver_view(lost)

    # SGLang's PD retract rebootstrap: the room fails with a reason
    again = DecodeRequest(req=request("again", 11, port), kv_receiver=None, is_rebootstrap=True)
    again.kv_receiver = get_kv_class(TransferBackend(backend), KVClassType.RECEIVER)(
        mgr=decode, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=11)
    again.kv_receiver.init(0)
    queue._submit_prefill_recompute(again)
    found["rebootstrap"] = receiver_view(again)
    return found


def dp_steps(backend: str, objects: dict) -> dict:
    """A prefill of two DP replicas (--dp-size 2, follow_bootstrap_room): the decode queue finds
    the DP size in the registry and routes room r to replica r % 2 (or to the request's
    disagg_prefill_dp_rank); a prefill replica refuses a room whose number names the other."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    port = registry_port(backend, objects)
    replicas = [build_manager("prefill", backend, port, rank, "--dp-size", "2")
                for rank in (0, 1)]
    decode = build_manager("decode", backend, port)
    objects["managers"] += [*replicas, decode]
    queue = decode_queue(decode, backend)
    found = {"prefill_rank_keys": [m.rank_key for m in replicas]}
    queue.add(request("odd", 7, port))
    queue._resolve_pending_reqs()
    queue.add(request("even", 10, port))
    queue.add(request("pinned", 13, port, prefill_dp_rank=0))
    found["rooms"] = {r.req.rid: receiver_view(r) for r in queue.queue}
    sender_class = get_kv_class(TransferBackend(backend), KVClassType.SENDER)
    senders = {
        "room 7 on replica 0": sender_class(mgr=replicas[0], bootstrap_addr=f"127.0.0.1:{port}",
                                            bootstrap_room=7),
        "room 7 on replica 1": sender_class(mgr=replicas[1], bootstrap_addr=f"127.0.0.1:{port}",
                                            bootstrap_room=7),
        "room 13 pinned to replica 0": sender_class(
            mgr=replicas[0], bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=13,
            req_has_disagg_prefill_dp_rank=True)}
    found["senders"] = {name: {"state": s.state, "failure": str(s.error or "")}
                        for name, s in senders.items()}
    objects["senders"] += senders.values()
    return found


def prefill_queue_steps(backend: str, objects: dict) -> dict:
    """SGLang's PrefillBootstrapQueue makes our sender (create_sender), then pop_bootstrapped
    polls it (all-reduced over gloo groups) and finalize_bootstrap inits it."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import TransferBackend

    port = registry_port(backend, objects)
    manager = build_manager("prefill", backend, port)
    objects["managers"].append(manager)
    group = gloo_group()
    queue = object.__new__(PrefillBootstrapQueue)
    queue.__dict__.update(
        kv_manager=manager, transfer_backend=TransferBackend(backend), bootstrap_port=port,
        queue=[], pp_size=1, max_input_len=1 << 20, scheduler_stage_metrics=None,
        req_to_metadata_buffer_idx_allocator=StandInIndexAllocator(),
        scheduler=StandInScheduler(attn_cp_cpu_group=group, attn_tp_cpu_group=group,
                                   processed_tokens_counter=0,
                                   token_to_kv_pool_allocator=StandInAllocator(
                                       page_size=PAGE_SIZE)))
    req = request("prefill", 21, port)
    req.metadata_buffer_index = -1
    queue.add(req, num_kv_heads=HEADS)
    sender = req.disagg_kv_sender
    objects["senders"].append(sender)
    found = {"class": type(sender).__name__, "queued": len(queue.queue),
             "max_new_tokens": req.sampling_params.max_new_tokens}
    popped = queue.pop_bootstrapped()
    found.update(popped=len(popped), left=len(queue.queue), state=sender.state,
                 num_pages=sender.num_pages, aux_index=sender.aux_index,
                 metadata_buffer_index=req.metadata_buffer_index)
    return found


def startup_refusals(backend: str, objects: dict) -> dict:
    """Configurations the backends cannot serve are refused when SGLang builds the manager."""
    cases = {
        "attention DP": ("decode", ("--attn-dp-size", "2", "--tp-size", "2"), {}),
        "attention DP, deprecated spelling": (
            "prefill", ("--dp-size", "2", "--enable-dp-attention", "--tp-size", "2"), {}),
        "attention CP": ("prefill", ("--attn-cp-size", "2", "--tp-size", "2"), {}),
        "PP": ("decode", ("--pp-size", "2"), {}),
        "prefill_complete": ("decode", ("--disaggregation-decode-allocation-policy",
                                        "prefill_complete"), {}),
        "DP replicas, round robin": ("prefill", ("--dp-size", "2", "--load-balance-method",
                                                 "round_robin"), {}),
        "forced DP-rank queries": (
            "decode", (), {"SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": "1"}),
        "staging buffer": ("decode", (), {"SGLANG_DISAGG_STAGING_BUFFER": "1"}),
        "DP replicas, follow_bootstrap_room": ("prefill", ("--dp-size", "2"), {}),
        "DP replicas, decode": ("decode", ("--dp-size", "2"), {}),
    }
    found = {}
    for name, (mode, extra, env) in cases.items():
        os.environ.update(env)
        try:
            manager = build_manager(mode, backend, registry_port(backend, objects), None, *extra)
            found[name] = "started"
            close = getattr(manager, "close", None)
            if close:
                close()
        except Exception as exc:  # noqa: BLE001 - the refusal is what the test reads
            found[name] = f"{type(exc).__name__}: {exc}"
        finally:
            for key in env:
                os.environ.pop(key, None)
    return found


def attribute_contract(objects: dict) -> dict:
    """Every attribute SGLang's queue code reads on a kv_manager / kv_receiver / sender exists
    on ours (every instance built above), unless SGLang guards that read with hasattr / getattr
    or it is listed in EXEMPT with its reason."""
    reads = scan_upstream()
    instances = {"manager": objects["managers"], "receiver": objects["receivers"],
                 "sender": objects["senders"]}
    missing, exempted = [], []
    for kind, attr in sorted(set(reads) | IMPLICIT):
        lacking = sorted({type(o).__name__ for o in instances[kind] if not hasattr(o, attr)})
        if not instances[kind]:
            lacking = ["(no instance was built)"]
        if not lacking:
            continue
        if (kind, attr) in EXEMPT:
            exempted.append(f"{kind}.{attr}")
            continue
        missing.append(f"{kind}.{attr} (read at {', '.join(reads.get((kind, attr), ['?'])[:3])};"
                       f" missing on {', '.join(lacking)})")
    stale = sorted(f"{k}.{a}" for k, a in EXEMPT if (k, a) not in reads)
    return {"scanned": len(reads), "files": sorted(SCANNED), "missing": missing,
            "exempted": exempted, "stale_exemptions": stale,
            "instances": {k: sorted({type(o).__name__ for o in v}) for k, v in instances.items()}}


def run() -> None:
    from sglang.srt import runtime_context
    from sglang.srt.plugins import load_plugins

    from pd_plugins.patches import sglang_backends

    load_plugins()
    # SGLang's own test hook: a published dummy runtime config (no model, no GPU)
    runtime_context.get_context().override_server_args(device="cpu", host="127.0.0.1").install()
    emit(event="version", found=sglang_backends.sglang_version(),
         checked=list(getattr(sglang_backends, "CHECKED_VERSIONS", ())))
    objects = {"managers": [], "receivers": [], "senders": [], "registries": []}
    for backend in BACKENDS:
        step("decode_queue", lambda: decode_queue_steps(backend, objects), backend=backend)
        step("dp_replicas", lambda: dp_steps(backend, objects), backend=backend)
        step("prefill_queue", lambda: prefill_queue_steps(backend, objects), backend=backend)
        step("startup_refusals", lambda: startup_refusals(backend, objects), backend=backend)
    step("attribute_contract", lambda: attribute_contract(objects))
    for manager in objects["managers"]:
        close = getattr(manager, "close", None)
        if close:
            close()
    for registry in objects["registries"]:
        registry.close()
    emit(event="done")
