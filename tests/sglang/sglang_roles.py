"""The SGLang side of tests/sglang: runs in .venv-sglang, one engine role per process.

It plays SGLang's scheduler for our backend the way prefill.py / decode.py do: classes come from
SGLang's own `get_kv_class` after its plugin loader ran, server args from SGLang's own parser, and
the lifecycle is SGLang's (sender: poll -> init -> send chunks -> poll until Success; receiver:
init -> poll -> send_metadata -> poll until Success). The engine's KV and metadata buffers are
host arrays filled with bytes derived from the room, so the other process can check them.

    python -m tests.sglang.sglang_roles registration
    python -m tests.sglang.sglang_roles startup
    python -m tests.sglang.sglang_roles prefill '<json spec>'   (prints one JSON line per event)
    python -m tests.sglang.sglang_roles decode '<json spec>'

The tests start roles through tests/sglang/role_forkserver.py, which forks them from one
interpreter that has imported this module (the same as the commands above, without the imports).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time

import numpy as np

from pd_plugins.testing.sglang_env import stub_gpu_only_packages

stub_gpu_only_packages()
os.environ.setdefault("SGLANG_PLUGINS", "pd_plugins")

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    KVClassType,
    TransferBackend,
)
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

# A small paged KV: 2 layers x (K, V), pages of 4 tokens, 2 heads x 8 dims float32.
LAYERS, PAGE_SIZE, HEADS, DIM, NUM_PAGES = 2, 4, 2, 8, 64
ITEM_BYTES = PAGE_SIZE * HEADS * DIM * 4
AUX_ROWS, AUX_ITEMS = (16, 16), (64, 32)   # two metadata buffers: rows, bytes per row
POLL_S = 0.01


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def thread_nice() -> list[int]:
    """The nice values of this process's threads (NIXL's are lowered by pd-nixl)."""
    values = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            values.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
    return sorted(values)


def server_args(mode: str, bootstrap_port: int, backend: str, tp_size: int = 1) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args([
        "--model-path", "unused", "--device", "cpu", "--host", "127.0.0.1",
        "--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend,
        "--disaggregation-bootstrap-port", str(bootstrap_port), "--tp-size", str(tp_size)])
    return ServerArgs.from_cli_args(args)


class EngineMemory:
    """What the engine's memory pools would hold: per-layer K and V pages, metadata rows."""

    def __init__(self, num_pages: int = NUM_PAGES, engine_rank: int = 0) -> None:
        self.engine_rank = engine_rank  # this rank's number in its engine's TP group
        self.kv = [np.zeros((num_pages, ITEM_BYTES), dtype=np.uint8) for _ in range(2 * LAYERS)]
        self.aux = [np.zeros((rows, width), dtype=np.uint8)
                    for rows, width in zip(AUX_ROWS, AUX_ITEMS)]

    def kv_args(self) -> KVArgs:
        args = KVArgs()
        args.engine_rank, args.system_dp_rank, args.page_size = self.engine_rank, 0, PAGE_SIZE
        args.kv_cache_dtype_str = "float32"
        args.kv_data_ptrs = [b.ctypes.data for b in self.kv]
        args.kv_data_lens = [b.nbytes for b in self.kv]
        args.kv_item_lens = [ITEM_BYTES] * len(self.kv)
        args.aux_data_ptrs = [b.ctypes.data for b in self.aux]
        args.aux_data_lens = [b.nbytes for b in self.aux]
        args.aux_item_lens = list(AUX_ITEMS)
        return args

    def fill(self, room: int, pages: list[int], aux_index: int) -> None:
        # bytes of this room on this rank: a decode rank given another rank's KV fails its check
        rng = np.random.default_rng([room, self.engine_rank])
        for buf in self.kv:
            buf[pages] = rng.integers(0, 256, (len(pages), ITEM_BYTES), dtype=np.uint8)
        for buf in self.aux:
            buf[aux_index] = rng.integers(0, 256, buf.shape[1], dtype=np.uint8)

    def digest(self, pages: list[int], aux_index: int | None) -> dict:
        """Per page, a SHA-256 over every layer's K and V item; and one over the metadata row."""
        kv = [hashlib.sha256(b"".join(buf[page].tobytes() for buf in self.kv)).hexdigest()
              for page in pages]
        aux = (hashlib.sha256(b"".join(b[aux_index].tobytes() for b in self.aux)).hexdigest()
               if aux_index is not None else None)
        return {"kv": kv, "aux": aux}


def kv_class(kind: KVClassType, backend: str):
    from sglang.srt.disaggregation.utils import get_kv_class

    return get_kv_class(TransferBackend(backend), kind)


def wait_for(obj, states: tuple[int, ...], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        state = obj.poll()
        if state in states or state == KVPoll.Failed or time.monotonic() > deadline:
            return state
        time.sleep(POLL_S)


def failure_of(obj) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:  # noqa: BLE001 - the reason is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return ""


def registration() -> None:
    load_plugins()
    from pd_plugins import sglang_plugin
    from sglang.srt.plugins.hook_registry import HookRegistry

    again = sglang_plugin.register()  # after SGLang's loader: registers nothing twice
    from sglang.srt.disaggregation import decode as decode_module
    from sglang.srt.disaggregation import prefill as prefill_module
    from sglang.srt.disaggregation.utils import get_kv_class

    for backend in ("pd-shm", "pd-nixl"):
        sa = server_args("prefill", 8998, backend)
        emit(backend=sa.disaggregation_transfer_backend,
             # the copies that SGLang's prefill and decode schedulers call
             schedulers={m.__name__.rsplit(".", 1)[1]: m.get_kv_class(
                 TransferBackend(backend), KVClassType.SENDER).__qualname__
                 for m in (prefill_module, decode_module)},
             classes={k.value: getattr(get_kv_class(TransferBackend(backend), k), "__qualname__",
                                       None) for k in KVClassType},
             nixl_manager=get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER).__qualname__,
             registered_again=again,
             hooks=len(HookRegistry._hooks["sglang.srt.disaggregation.utils.get_kv_class"]))


def kv_checks(manager) -> dict:
    """pd-nixl: the faults this process injected so far and its receivers' verdicts."""
    if not hasattr(manager, "faults"):
        return {}
    return {"faults_injected": dict(manager.faults.injected),
            "kv_checks": dict(manager.checks.counts)}


def prefill(spec: dict) -> None:
    """Prefill rooms {room, pages, chunks, aux_index, abort}: send them all ("published", with
    digests), then poll every sender until it concludes ("sent"), then stay up a while. One TP
    rank (`engine_rank` of `tp_size`); SGLang runs one bootstrap registry per prefill instance,
    here in rank 0's process (`registry`: false in the others)."""
    load_plugins()
    port, backend = spec["bootstrap_port"], spec.get("backend", "pd-shm")
    registry = (kv_class(KVClassType.BOOTSTRAP_SERVER, backend)(host="127.0.0.1", port=port)
                if spec.get("registry", True) else None)
    memory = EngineMemory(spec.get("num_pages", NUM_PAGES), spec.get("engine_rank", 0))
    manager = kv_class(KVClassType.MANAGER, backend)(
        memory.kv_args(), DisaggregationMode.PREFILL,
        server_args("prefill", port, backend, spec.get("tp_size", 1)), False)
    emit(event="ready")
    senders = {}
    for job in spec["rooms"]:
        room, pages, aux_index = job["room"], job["pages"], job["aux_index"]
        memory.fill(room, pages, aux_index)
        sender = kv_class(KVClassType.SENDER, backend)(manager, f"127.0.0.1:{port}", room)
        wait_for(sender, (KVPoll.WaitingForInput,), 5)
        sender.init(len(pages), aux_index)
        if job.get("abort"):
            sender.abort()
        else:
            for chunk in np.array_split(np.array(pages, dtype=np.int32), job.get("chunks", 1)):
                if sender.should_send_kv_chunk(len(chunk), last_chunk=False):
                    sender.send(chunk)
        senders[room] = sender
        emit(event="published", room=room, **memory.digest(pages, aux_index))
    # Longer than the tests' 120 s lease: each decode is a fresh process that may take a minute to
    # import on a loaded 2-core host, and a pull room concludes only when its read is done.
    deadline = time.monotonic() + spec.get("wait_s", 240)
    while senders and time.monotonic() < deadline:
        for room, sender in list(senders.items()):
            state = sender.poll()
            if state in (KVPoll.Success, KVPoll.Failed):
                emit(event="sent", room=room, state=state,
                     failure=failure_of(sender) if state == KVPoll.Failed else "",
                     metric=sender.get_transfer_metric().__dict__, **kv_checks(manager))
                del senders[room]
        time.sleep(POLL_S)
    for room in senders:
        emit(event="sent", room=room, state=senders[room].poll(), failure="still transferring")
    time.sleep(spec.get("then_sleep_s", 0))
    if registry is not None:
        registry.close()


def decode(spec: dict) -> None:
    """Receive rooms one after another, as one decode engine does: `spec["receives"]` lists
    {room, dest, aux_index, prefix_len, abort, wait_s, bootstrap_s, bootstrap_port} (or `spec` is
    one of them). Each room goes into pages `dest` after a cached prefix of `prefix_len` tokens,
    from the prefill at the job's bootstrap port (by default the spec's). With `together`, all
    rooms at once instead (`receive_together`)."""
    load_plugins()
    memory = EngineMemory(spec.get("num_pages", NUM_PAGES), spec.get("engine_rank", 0))
    backend = spec.get("backend", "pd-shm")
    manager = kv_class(KVClassType.MANAGER, backend)(
        memory.kv_args(), DisaggregationMode.DECODE,
        server_args("decode", spec["bootstrap_port"], backend, spec.get("tp_size", 1)), False)
    if spec.get("together"):
        return receive_together(manager, memory, backend, spec["bootstrap_port"],
                                spec["receives"], spec.get("wait_s", 90))
    for job in spec.get("receives", [spec]):
        receive_room(manager, memory, backend, job.get("bootstrap_port", spec["bootstrap_port"]),
                     job)


def receive_room(manager, memory: EngineMemory, backend: str, bootstrap_port: int,
                 job: dict) -> None:
    receiver = kv_class(KVClassType.RECEIVER, backend)(
        manager, f"127.0.0.1:{bootstrap_port}", job["room"])
    receiver.init(0)
    state = wait_for(receiver, (KVPoll.WaitingForInput,), job.get("bootstrap_s", 10))
    if state == KVPoll.WaitingForInput:
        emit(event="bootstrapped", room=job["room"])
        if job.get("abort"):
            receiver.abort()
        receiver.send_metadata(np.array(job["dest"], dtype=np.int32), job["aux_index"], None,
                               decode_prefix_len=job.get("prefix_len", 0))
        state = wait_for(receiver, (KVPoll.Success,), job.get("wait_s", 30))
    emit_received(manager, memory, backend, receiver, job, state)


def receive_together(manager, memory: EngineMemory, backend: str, bootstrap_port: int,
                     jobs: list[dict], wait_s: float) -> None:
    """Rooms at once, as a decode scheduler polls its whole queue: each receiver gets its pages
    as soon as it is bootstrapped, and "received" comes in the order the rooms conclude (their
    `dest` pages must not overlap: an engine never gives two rooms the same pages)."""
    pending = {}
    for job in jobs:
        receiver = kv_class(KVClassType.RECEIVER, backend)(
            manager, f"127.0.0.1:{bootstrap_port}", job["room"])
        receiver.init(0)
        pending[job["room"]] = (receiver, job)
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        for room, (receiver, job) in list(pending.items()):
            state = receiver.poll()
            if state == KVPoll.WaitingForInput:
                receiver.send_metadata(np.array(job["dest"], dtype=np.int32), job["aux_index"],
                                       None, decode_prefix_len=job.get("prefix_len", 0))
            elif state in (KVPoll.Success, KVPoll.Failed):
                emit_received(manager, memory, backend, receiver, job, state)
                del pending[room]
        time.sleep(POLL_S)
    for receiver, job in pending.values():
        emit_received(manager, memory, backend, receiver, job, receiver.poll())


def decode_queue_reads(receiver) -> str:
    """What SGLang's decode queue reads of a concluded receiver (decode.py pop_transferred, for
    a failed room; an AttributeError there stops the scheduler): "ok", or the error."""
    try:
        deferred = receiver.kv_mgr.enable_deferred_decode_kv_release
        return "ok" if (deferred, receiver.abort_notified, receiver.conclude_state) else "?"
    except AttributeError as exc:
        return f"AttributeError: {exc}"


def emit_received(manager, memory: EngineMemory, backend: str, receiver, job: dict,
                  state: int) -> None:
    emit(event="received", room=job["room"], state=state,
         failure=failure_of(receiver) if state == KVPoll.Failed else "",
         decode_queue_reads=decode_queue_reads(receiver),
         concluded=getattr(receiver, "conclude_state", "missing")
         if state in (KVPoll.Success, KVPoll.Failed) else None,
         thread_nice=thread_nice(),
         pool_after=manager.pool.stats().__dict__ if backend == "pd-shm" else None,
         kv_verdict=getattr(receiver, "kv_verdict", None), **kv_checks(manager),
         **memory.digest(job["dest"], job["aux_index"]))


def device_memory() -> None:
    """Where each backend takes the KV to be, by SGLang's `--device`, and how pages are addressed
    there (no GPU needed: device KV is only addressed, never touched, by this code)."""
    from pd_plugins.connectors.sglang.host_kv import EngineBuffers, kv_memory_of
    from pd_plugins.transfer.nixl_rooms import Memory

    load_plugins()
    memory, sa = EngineMemory(), server_args("prefill", 8998, "pd-shm")
    args = memory.kv_args()
    args.gpu_id = 3
    found = {}
    for device in ("cpu", "cuda", "npu", None):  # None: --device omitted, no GPU here
        sa.device = device
        try:
            found[str(device)] = list(kv_memory_of(sa, args))
        except NotImplementedError as exc:
            found[str(device)] = f"NotImplementedError: {exc}"
    sa.device = "cuda"
    try:
        kv_class(KVClassType.MANAGER, "pd-shm")(args, DisaggregationMode.PREFILL, sa, False)
        shm_on_cuda = "accepted"
    except NotImplementedError as exc:
        shm_on_cuda = f"NotImplementedError: {exc}"
    pages = [3, 7]
    host = EngineBuffers(args)
    device = EngineBuffers(args, Memory("VRAM", 3))
    try:
        device.gather_pages(np.asarray(pages))
        gather_on_device = "gathered"
    except RuntimeError as exc:
        gather_on_device = f"RuntimeError: {exc}"
    emit(event="device_memory", memory=found, shm_on_cuda=shm_on_cuda,
         gather_on_device=gather_on_device,
         host_ranges=host.page_ranges(pages), device_ranges=device.page_ranges(pages),
         row_views=[[buf[p].ctypes.data, buf.shape[1]] for buf in memory.kv for p in pages],
         device_row_views=len(device.kv))


def state_refusal() -> None:
    """Both backends' managers for a model whose KV has state buffers (SGLang fills
    `kv_args.state_types` before it builds the manager): refused at the start."""
    from sglang.srt.disaggregation.base.conn import StateType

    load_plugins()
    refused = {}
    for backend in ("pd-shm", "pd-nixl"):
        args = EngineMemory().kv_args()
        args.state_types = [StateType.MAMBA, StateType.SWA]
        try:
            kv_class(KVClassType.MANAGER, backend)(
                args, DisaggregationMode.PREFILL, server_args("prefill", 8998, backend), False)
            refused[backend] = "accepted"
        except NotImplementedError as exc:
            refused[backend] = f"NotImplementedError: {exc}"
    emit(event="state_refusal", refused=refused)


def malformed_peer_records() -> None:
    """Rooms handed a malformed peer record (a decode's view of the prefill's rank record in the
    bootstrap registry; a push prefill's view of the decode's target) fail that room; nothing
    escapes poll(), where SGLang's scheduler would stop. The managers are stand-ins (only what
    a room reads of them): the rooms' own handling of the record is what runs."""
    import types

    from pd_plugins.connectors.sglang import pd_nixl, pd_shm
    from pd_plugins.transfer import bootstrap_registry as registry

    def outcome(room) -> str:
        try:
            state = room.poll()
        except Exception as exc:  # noqa: BLE001 - what the test reports
            return f"escaped: {type(exc).__name__}: {exc}"
        return f"failed: {room.error}" if state == KVPoll.Failed else f"state {state}"

    from pd_plugins.transfer.nixl_rooms import LeaseTable

    outcomes, leases_kept = {}, {}
    lookup, target_action = registry.lookup, registry.target_action
    try:
        for cls, backend in ((pd_nixl.PdNixlKVReceiver, "pd-nixl"),
                             (pd_shm.PdShmKVReceiver, "pd-shm")):
            # a rank record of the right backend and page size, and nothing else
            registry.lookup = (lambda addr, key, timeout_s=5.0, b=backend:
                               {"backend": b, "page_bytes": 64})
            mgr = types.SimpleNamespace(
                backend_name=backend, transfer_mode="pull",
                kv_args=types.SimpleNamespace(engine_rank=0),
                server_args=types.SimpleNamespace(tp_size=1),
                buffers=types.SimpleNamespace(page_bytes=64),
                agent=types.SimpleNamespace(add_peer=lambda metadata, name: "peer"),
                pool=types.SimpleNamespace(pool_id=None),
                settled=lambda room: None)  # pd-nixl: a concluded room's notifications go
            room = object.__new__(cls)
            room.mgr, room.prefill_addr, room.room, room.prefill_dp_rank = mgr, "p:1", 7, 0
            room.state, room.bootstrap_deadline = KVPoll.Bootstrapping, time.monotonic() + 30
            room.initialised = True  # SGLang called init(): poll bootstraps
            outcomes[f"{backend} receiver"] = outcome(room)
        mgr = object.__new__(pd_nixl.PdNixlKVManager)  # its own peer_items() checks the kv items
        mgr.transfer_mode, mgr.bootstrap_addr, mgr.rank_key = "push", "x:1", "0.0"
        mgr.agent = types.SimpleNamespace(add_peer=lambda metadata, name: "peer")
        mgr.buffers = types.SimpleNamespace(page_items=lambda: [(1000, 64)], num_pages=8)
        mgr.pump = lambda: None
        for name, target in (("kv not pairs", {"agent_metadata": "", "kv": [1]}),
                             ("no agent_metadata", {"kv": [[1, 64]]}),
                             ("first_page null",
                              {"agent_metadata": "", "kv": [[1, 64]], "first_page": None})):
            registry.target_action = lambda addr, key, action, t=target: (200, t)
            room = object.__new__(pd_nixl.PdNixlKVSender)
            room.mgr, room.room, room.state, room.num_pages, room.next_page, room.pages = \
                mgr, 7, KVPoll.Transferring, 1, 1, [3]
            mgr.leases = LeaseTable(60.0)
            mgr.leases.lease(7)  # the room's pages, held for the decode
            outcomes[f"pd-nixl push sender: {name}"] = outcome(room)
            leases_kept[name] = mgr.leases.until(7) > 0  # a failed room's lease must go
    finally:
        registry.lookup, registry.target_action = lookup, target_action
    emit(event="malformed_peer_records", outcomes=outcomes, leases_kept=leases_kept)


def pool_verification() -> None:
    """pd-shm's PD_VERIFY_KV at a manager's start, on the pool PD_SHM_POOL names: which pools
    get checksums, which are refused; and PD_KV_FAULTS without permission."""
    from pd_plugins.transfer.shm_pool import remove_pool

    memory, sa = EngineMemory(), server_args("decode", 8998, "pd-shm")

    def manager(verify: str, **env: str):
        os.environ.update(PD_VERIFY_KV=verify, **env)
        try:
            return kv_class(KVClassType.MANAGER, "pd-shm")(
                memory.kv_args(), DisaggregationMode.DECODE, sa, False)
        except (RuntimeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            for name in env:
                del os.environ[name]

    off = manager("off")  # creates the pool
    required, on = manager("required"), manager("on")
    faults = manager("on", PD_KV_FAULTS="flip_slot", PD_KV_FAULTS_ALLOWED="")
    found = {"off": off.pool.checksums, "required": required, "on_existing": on.pool.checksums,
             "faults": faults}
    for opened in (off, on):
        opened.close()
    remove_pool(os.environ["PD_SHM_POOL"])
    created = manager("on")
    found["on_new"] = created.pool.checksums
    created.close()
    emit(event="pool_verification", **found)


def main(argv: list[str]) -> None:
    """`argv`: the role, then its JSON spec (prefill and decode)."""
    os.environ.setdefault("SGLANG_PLUGINS", "pd_plugins")  # again: a forked role's own environment
    role = argv[0]
    if role == "registration":
        registration()
    elif role == "contract":  # SGLang's own queues over our classes: tests/sglang/sglang_contract.py
        from tests.sglang import sglang_contract

        sglang_contract.run()
    elif role == "startup":  # the managers' start-time checks, in one process
        device_memory()
        pool_verification()
        state_refusal()
        malformed_peer_records()
    elif role == "peer":  # tests/sglang/peer_roles.py
        from tests.sglang import peer_roles

        peer_roles.main(argv[1:])
    else:
        {"prefill": prefill, "decode": decode}[role](json.loads(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
