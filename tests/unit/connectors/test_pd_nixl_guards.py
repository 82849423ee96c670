"""PdNixlConnector's guards, on their own (the e2e tests run them inside real vLLM engines)."""

import pytest

from pd_plugins.connectors.vllm.pd_nixl_guards import LeaseVerdicts, NotifTap, PushDeadlines, SendHold
from pd_plugins.transfer.lease_check import VerdictTable


class FakeAgent:
    """Stands in for a NIXL agent (named as a fake: only its notification queue matters here)."""

    name = "prefill-agent"

    def __init__(self, notifs):
        self.notifs = notifs

    def get_new_notifs(self):
        notifs, self.notifs = self.notifs, {}
        return notifs


def test_notif_tap_classifies_completions_against_the_lease_and_passes_everything_on():
    notifs = {"decode-a": [b"req-1:1", b"HB:req-1,req-2"], "decode-b": [b"req-2:1"]}
    leased = {"req-1"}
    tap = NotifTap(FakeAgent(dict(notifs)), lambda r: r in leased, rank=1)
    assert tap.get_new_notifs() == notifs  # upstream sees exactly what NIXL delivered
    assert tap.name == "prefill-agent"     # everything else goes to the agent
    verdicts = tap.take_verdicts()
    assert verdicts.verdicts == [("req-1", "decode-a", True, 1), ("req-2", "decode-b", False, 1)]
    assert tap.take_verdicts() is None
    table = VerdictTable()
    # another rank's verdicts, as vLLM gathers the workers' metadata
    verdicts.aggregate(LeaseVerdicts([("req-3", "decode-a", True, 0),
                                      ("req-1", "decode-a", True, 0)])).record_into(table)
    assert [table.lookup(r, a) for r, a in [("req-1", "decode-a"), ("req-2", "decode-b"),
                                            ("req-3", "decode-a")]] == ["ok", "late", "ok"]
    assert table.lookup("req-1", "decode-a", ranks=2) == "ok"  # both ranks said on time
    assert table.lookup("req-3", "decode-a", ranks=2) == "pending"


def test_notif_tap_keeps_no_verdict_for_an_id_too_long_to_ask_about():
    # any NIXL peer can send a notification: megabytes of request id would be kept per entry
    from pd_plugins.transfer.lease_check import MAX_ID_BYTES

    long_id = b"r" * MAX_ID_BYTES + b":1"  # with the reader's name, past what a check carries
    notifs = {"decode-a": [long_id, b"req-1:1"], "x" * MAX_ID_BYTES: [b"req-2:1"]}
    tap = NotifTap(FakeAgent(dict(notifs)), lambda r: True)
    assert tap.get_new_notifs() == notifs  # upstream still sees them all
    assert tap.take_verdicts().verdicts == [("req-1", "decode-a", True, 0)]


def test_push_deadline_fails_the_load_once_and_drops_the_late_completion():
    deadlines = PushDeadlines()
    deadlines.expect({"a": 10.0, "b": 10.0}, now=0.0)
    finished, failed = {"a"}, set()
    assert deadlines.settle(finished, failed, now=5.0) == set()
    assert finished == {"a"} and len(deadlines) == 1
    finished, failed = set(), set()
    assert deadlines.settle(finished, failed, now=10.0) == {"b"}
    assert finished == {"b"} and failed == {"b"}  # vLLM wants failed loads in both
    finished, failed = {"b"}, set()  # the push completed after all: too late, drop it
    deadlines.settle(finished, failed, now=11.0)
    assert finished == set() and failed == set() and len(deadlines) == 0


def test_send_hold_keeps_blocks_while_a_write_is_in_flight():
    hold = SendHold(max_hold_s=30.0)
    sending = {"expired-mid-write", "done"}
    assert hold.settle(sending, in_flight={"expired-mid-write"}, now=0.0) == {"expired-mid-write"}
    assert sending == {"done"}
    sending = set()
    hold.settle(sending, in_flight={"expired-mid-write"}, now=1.0)
    assert sending == set()
    hold.settle(sending, in_flight=set(), now=2.0)  # the WRITE ended: free now
    assert sending == {"expired-mid-write"}


def test_send_hold_gives_up_on_a_stuck_write():
    hold = SendHold(max_hold_s=30.0)
    sending = {"r"}
    hold.settle(sending, in_flight={"r"}, now=0.0)
    sending = set()
    hold.settle(sending, in_flight={"r"}, now=30.0)
    assert sending == {"r"}


class FakePushWorker:
    """Only the lease bookkeeping and the WRITE start of a push worker (a named fake)."""

    def __init__(self):
        self._reqs_to_send: dict[str, float] = {}
        self._reqs_to_process: set[str] = set()
        self.started: list[str] = []

    def _do_start_push_kv(self, request_id, blocks, registration):
        self.started.append(request_id)


def test_write_gate_starts_only_leased_writes_the_decode_still_waits_for():
    import time as clock

    from pd_plugins.connectors.vllm.pd_nixl_guards import WRITE_BY_KEY, WriteGate

    worker = FakePushWorker()
    gate = WriteGate(worker)
    later = clock.perf_counter() + 60
    worker._reqs_to_send.update({"leased": later, "expired": clock.perf_counter() - 1,
                                 "decode-gone": later})
    worker._reqs_to_process.update({"leased", "expired", "decode-gone", "finishing"})
    worker._do_start_push_kv("leased", [[1]], {WRITE_BY_KEY: clock.time() + 30})
    worker._do_start_push_kv("finishing", [[1]], {})  # lease not stamped yet: still its own
    worker._do_start_push_kv("expired", [[1]], {})
    worker._do_start_push_kv("decode-gone", [[1]], {WRITE_BY_KEY: clock.time() - 1})
    worker._do_start_push_kv("released", [[1]], {})
    assert worker.started == ["leased", "finishing"]
    assert gate.take_refused() == 3 and gate.take_refused() == 0


def test_write_gate_asks_before_write_and_skips_the_write_it_declines():
    import time as clock

    from pd_plugins.connectors.vllm.pd_nixl_guards import WriteGate

    worker = FakePushWorker()
    gate = WriteGate(worker)
    asked = []
    gate.before_write = lambda r, blocks, reg: asked.append(r) or r != "dropped"
    worker._reqs_to_send.update({"kept": clock.perf_counter() + 60,
                                 "dropped": clock.perf_counter() + 60})
    worker._reqs_to_process.update({"kept", "dropped"})
    for request_id in ("kept", "dropped", "released"):
        worker._do_start_push_kv(request_id, [[1]], {})
    assert asked == ["kept", "dropped"]  # a refused WRITE is not asked about
    assert worker.started == ["kept"] and gate.take_refused() == 1


# -- notifications upstream's parser cannot take ---------------------------------------------------
# Upstream 0.32 parses every notification on the engine's main thread (pull_worker/push_worker
# `_get_new_notifs`, no try/except): one that raises there ends the engine.
MALFORMED_NOTIFS = [b"junk-without-colon", b"\xff\xfe:1", b"req-1:notanint", b"req-1:",
                    b"req-1:0", b"req-1:\xd9\xa1", b"HB:\xff", b"PDKVD:\x93\xaacm"]


def _with_upstream_heartbeats(worker):
    """Upstream's own heartbeat handler on a stand-in worker."""
    from types import MethodType

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )

    worker._lease_extension = 30
    worker._handle_heartbeat = MethodType(NixlBaseConnectorWorker._handle_heartbeat, worker)
    return worker


def _pull_prefill(agent):
    """The state upstream's pull `_get_new_notifs` reads: a prefill holding req-1's blocks."""
    import collections
    from types import SimpleNamespace

    return _with_upstream_heartbeats(SimpleNamespace(
        transfer_topo=object(), nixl_wrapper=agent,
        _reqs_to_send={"req-1": 1e18}, _reqs_to_process={"req-1"},
        expected_consumer_notifications_by_req={},
        consumer_notification_counts_by_req=collections.defaultdict(int),
        xfer_stats=SimpleNamespace(record_notification_after_expiry=lambda: None)))


def test_notif_tap_drops_and_counts_what_upstreams_pull_parser_raises_on():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    for bad in MALFORMED_NOTIFS:
        tap = NotifTap(FakeAgent({"peer": [bad, b"HB:req-1"]}), lambda r: True)
        worker = _pull_prefill(tap)
        assert NixlPullConnectorWorker._get_new_notifs(worker) == set(), bad  # raised before
        assert tap.take_dropped() == 1 and tap.take_dropped() == 0
        assert tap.take_verdicts() is None
    # what upstream sends still reaches it, and still frees the blocks
    tap = NotifTap(FakeAgent({"decode": [b"req-1:1"]}), lambda r: True)
    assert NixlPullConnectorWorker._get_new_notifs(_pull_prefill(tap)) == {"req-1"}
    assert tap.take_dropped() == 0


def test_the_filter_passes_every_format_upstream_sends():
    import msgspec

    from pd_plugins.connectors.vllm.pd_nixl_guards import NotifFilter

    legitimate = [b"cmpl-1-0:1", b"chatcmpl-a:b:c:2", "r\u00e9q:4".encode(), b"HB:a,b,c", b"HB:"]
    pull, push = NotifFilter(None), NotifFilter(None, push=True, tp_size=lambda: 2)
    registration = b"PUSH_REG:" + msgspec.msgpack.encode({"request_id": "x"})
    assert all(pull.why_dropped(m) is None for m in legitimate)
    assert all(push.why_dropped(m) is None for m in legitimate + [registration])
    assert pull.why_dropped(registration) is not None  # a pull engine never gets one
    assert push.why_dropped(b"req:3") is not None  # upstream's tp_ratio(3) asserts at TP 2
    assert push.why_dropped(b"req:1") is None and push.why_dropped(b"req:8") is None


class _Once:
    """is_set() for upstream's writer loop: run the loop body once."""

    def __init__(self):
        self.calls = 0

    def is_set(self):
        self.calls += 1
        return self.calls > 1


def _push_worker(agent):
    """The state upstream's push writer loop and main-thread `_get_new_notifs` read."""
    import collections
    import queue
    import threading
    from types import SimpleNamespace

    wake = threading.Event()
    wake.set()
    expired = []
    return _with_upstream_heartbeats(SimpleNamespace(
        xfer_stats=SimpleNamespace(record_notification_after_expiry=lambda: expired.append(1)),
        transfer_topo=SimpleNamespace(tp_size=1), world_size=1, nixl_wrapper=agent,
        _push_writer_stop=_Once(), _push_writer_wake=wake, _push_finished_blocks={},
        _reg_send_inbox=queue.Queue(), _deferred_push_inbox=queue.Queue(),
        _finished_blocks_inbox=queue.Queue(), _evict_finished_inbox=queue.Queue(),
        _pending_completion_notifs=queue.Queue(), _pending_d_registrations={},
        _reqs_to_send={}, _reqs_to_process=set(), _recving_metadata={},
        _recving_transfers=collections.defaultdict(list), expired=expired,
        consumer_notification_counts_by_req=collections.defaultdict(int)))


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_push_workers_drop_what_upstreams_push_parser_raises_on(role):
    """A push decode without a DigestInbox (`verify_kv: off`) and a push prefill: the filter the
    connector installs, under upstream's real writer loop and main-thread parser."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    from pd_plugins.connectors.vllm.pd_nixl import PdNixlPushConnector
    from pd_plugins.connectors.vllm.pd_nixl_verify import push_digests_notif

    digests = push_digests_notif("cmpl-abc-0", 0, "AAAAAAAAAAA=")
    for bad in MALFORMED_NOTIFS + [digests]:
        worker = _push_worker(FakeAgent({"peer": [bad, b"HB:x"]}))
        connector = SimpleNamespace(connector_worker=worker, _notif_tap=None, pd_mode="push",
                                    _serves=role == "kv_producer")
        PdNixlPushConnector._set_up_notif_filter(connector)
        NixlPushConnectorWorker._push_writer_loop(worker)  # fetches, forwards to the main thread
        assert NixlPushConnectorWorker._get_new_notifs(worker) == set(), bad  # raised before
        assert connector._notif_filter.take_dropped() == 1


def test_a_push_prefill_drops_a_count_upstreams_tp_ratio_asserts_on():
    from types import SimpleNamespace  # noqa: F811

    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    from pd_plugins.connectors.vllm.pd_nixl import PdNixlPushConnector

    for count, passed in ((b"3", False), (b"0", False), (b"2", True)):
        worker = _push_worker(FakeAgent({"decode": [b"leased:" + count]}))
        worker.transfer_topo = TransferTopology(
            tp_rank=0, tp_size=2, block_size=16, engine_id="p", is_mla=False, is_mamba=False,
            total_num_kv_heads=4, attn_backends=[])
        worker.world_size = 2
        worker._reqs_to_process.add("leased")
        connector = SimpleNamespace(connector_worker=worker, _notif_tap=None, pd_mode="push",
                                    _serves=True)
        PdNixlPushConnector._set_up_notif_filter(connector)
        NixlPushConnectorWorker._push_writer_loop(worker)
        NixlPushConnectorWorker._get_new_notifs(worker)
        assert connector._notif_filter.take_dropped() == (0 if passed else 1)


# -- pull reads that cannot start ------------------------------------------------------------------
class _DoneAgent:
    """A NIXL agent stand-in (named as one): no notifications, every transfer done."""

    def __init__(self):
        self.posted = []

    def get_new_notifs(self):
        return {}

    def check_xfer_state(self, handle):
        return "DONE"

    def make_prepped_xfer(self, *args, **kwargs):
        self.posted.append(args)
        return len(self.posted)


def _pull_decode():
    """An upstream pull worker (its real class and methods) holding what start_load_kv and
    get_transfer_results read: a decode handshaked with prefill "p" (64 blocks of 16 tokens, TP 1),
    without a NIXL agent, KV caches or a forward pass (stood in for)."""
    import collections
    import queue
    import threading
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.utils import (
        EngineTransferInfo,
        TransferTopology,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import TPMapping

    worker = object.__new__(NixlPullConnectorWorker)
    topology = TransferTopology(tp_rank=0, tp_size=1, block_size=16, engine_id="d", is_mla=False,
                                is_mamba=False, total_num_kv_heads=4, attn_backends=[])
    topology.register_remote_engine("p", EngineTransferInfo(
        remote_tp_size=1, remote_block_len=1024, remote_block_size=16,
        remote_physical_blocks_per_logical=1))
    worker.__dict__.update(
        transfer_topo=topology, engine_id="d", tp_rank=0, nixl_wrapper=_DoneAgent(),
        _TRANSFER_MODE="pull", _physical_blocks_per_logical_kv_block=1, dcp_size=1, pcp_rank=0,
        pcp_dcp_sharded=False, use_mla=False, _has_mamba=False, _is_hma_required=False,
        _mixed_mem_types=False, _bidirectional_kv_xfer_enabled=False,
        _recving_metadata={}, _recving_transfers=collections.defaultdict(list),
        _ready_requests=queue.Queue(), _failed_recv_reqs=queue.Queue(), _recv_failures=set(),
        _invalid_block_ids=queue.Queue(), _pending_recv_notifs={}, _reqs_to_process=set(),
        _reqs_to_send={}, _replicated_pcp_done_sending=set(), _invalid_remote_engines=set(),
        _failed_remote_engines=set(), _remote_agents={"p": {(0, 0): "prefill-agent"}},
        _handshake_lock=threading.RLock(), _engine_last_active={},
        expected_consumer_notifications_by_req={},
        consumer_notification_counts_by_req=collections.defaultdict(int),
        tp_mappings={"p": TPMapping(source_ranks_per_group=((0,),), all_source_ranks=(0,),
                                    rank_to_attention_slot={0: 0}, rank_offset_factor=1)},
        dst_region_group_ids={"p": [0]}, region_group_ids=[0], dst_num_blocks={"p": 64, "d": 64},
        dst_region_num_blocks={}, dst_uses_region_group_mapping={"p": False},
        _uses_region_group_mapping=False, num_regions=1, block_len_per_layer=[1024],
        _transfer_layer_group_ids=[], src_xfer_handles_by_block_size={16: 1},
        dst_xfer_side_handles={"p": {0: 2}},
        kv_cache_config=SimpleNamespace(transfer_groups=[object()]),
        xfer_stats=SimpleNamespace(record_failed_transfer=lambda: None,
                                   record_transfer=lambda res: None))
    worker._send_heartbeats = lambda metadata: None
    worker.get_xfer_telemetry = lambda handle: None
    for name in ("_sync_device_after_direct_recv", "_reap_expired_send_leases",
                 "_cleanup_remote_engines"):
        setattr(worker, name, lambda *args: None)
    return worker


def _read_of(block_ids, req_id="dec"):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv(req_id, [[5, 6, 7, 8]], {  # the decode reads into 4 blocks
        "remote_block_ids": block_ids, "remote_engine_id": "p", "remote_request_id": "leg",
        "remote_host": "127.0.0.1", "remote_port": 5600}, awaiting_kvs=True)
    return meta


@pytest.mark.parametrize("block_ids", [[[0]], [[]], [[2**31, 2**31 + 1, 2**31 + 2, 2**31 + 3]],
                                       [[10, 11, 12, 64]]])
def test_a_read_that_cannot_start_is_a_failed_load_not_an_engine_death(block_ids):
    """Upstream's start_load_kv (the engine's main thread, no try/except) asserted on a list
    shorter than the decode's allocation and raised OverflowError on an id past int32; an id past
    the prefill's 64 blocks read another layer's memory. Each is a failed receive now, reported
    by upstream's own get_transfer_results (kv_load_failure_policy applies)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from pd_plugins.connectors.vllm.pd_nixl_guards import ReadStarts

    worker = _pull_decode()
    starts = ReadStarts(worker)
    NixlPullConnectorWorker.start_load_kv(worker, _read_of(block_ids))  # raised before
    assert worker.nixl_wrapper.posted == []  # nothing read
    results = NixlPullConnectorWorker.get_transfer_results(worker)
    assert results.finished_recving == results.failed_recving == {"dec"}
    assert worker._invalid_block_ids.get_nowait() == {5, 6, 7, 8}
    assert starts.take_failed() == 1
    # a good read on the same worker still starts
    NixlPullConnectorWorker.start_load_kv(worker, _read_of([[0, 1, 2, 3]], "good"))
    assert len(worker.nixl_wrapper.posted) == 1 and starts.take_failed() == 0


def test_reads_that_could_not_start_are_counted_on_metrics():
    """ReadStarts' refused starts were logged only: the connector's get_transfer_results counts
    them (vllm:pd_nixl_refused_reads), as it does dropped notifications."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from pd_plugins.connectors.vllm.pd_nixl import PdNixlPullConnector
    from pd_plugins.connectors.vllm.pd_nixl_guards import ReadStarts
    from pd_plugins.connectors.vllm.pd_nixl_stats import PD_COUNTERS, PdNixlStats

    worker = _pull_decode()
    starts = ReadStarts(worker)
    NixlPullConnectorWorker.start_load_kv(worker, _read_of([[10, 11, 12, 64]]))  # past 64
    results = NixlPullConnectorWorker.get_transfer_results(worker)
    class Connector(PdNixlPullConnector):  # built without its engine: this call's state
        pass

    Connector.__abstractmethods__ = frozenset()
    conn = object.__new__(Connector)
    stats = PdNixlStats()
    conn.__dict__.update(
        connector_worker=SimpleNamespace(get_transfer_results=lambda: results, pcp_rank=0,
                                         xfer_stats=stats),
        kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"), _connector_metadata=None,
        _read_starts=starts, _write_gate=None, _notif_filter=None, _digest_inbox=None,
        _late_read_guard=None, _push_deadlines=None, _send_hold=None,
        _recompute_failed_loads=False, _verify_reads=lambda *args: 0)
    assert conn.get_transfer_results(set()).failed_recving == {"dec"}
    assert stats.data.get("pd_refused_reads") == [1]
    assert PD_COUNTERS["pd_refused_reads"][0] == "vllm:pd_nixl_refused_reads"
    conn.get_transfer_results(set())  # taken once
    assert stats.data.get("pd_refused_reads") == [1]


def test_a_push_given_up_is_forgotten_upstream_so_its_late_completion_is_never_reported():
    """Upstream kept a timed-out push's `_recving_metadata` forever, and a completion that came
    after the deadline made it a finished receive again once 10,000 later timeouts had pushed it
    out of `_given_up`: vLLM's scheduler asserts on a receive it no longer waits for (the engine
    dies). Upstream's real push parser, on the state the decode worker keeps."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import ReqMeta
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    worker = _push_worker(FakeAgent({}))
    deadlines = PushDeadlines(worker)
    worker._recving_metadata["victim"] = ReqMeta(local_block_ids=[[5]],
                                                 local_physical_block_ids=[[5]], tp_size=1)
    worker.consumer_notification_counts_by_req["victim"] = 0
    deadlines.expect({"victim": 1.0}, now=0.0)
    finished, failed = set(), set()
    assert deadlines.settle(finished, failed, now=2.0) == {"victim"}
    assert worker._recving_metadata == {}  # nothing left behind (a prefill that never writes)
    assert "victim" not in worker.consumer_notification_counts_by_req
    worker._pending_completion_notifs.put(b"victim:1")  # the prefill's WRITE, late
    NixlPushConnectorWorker._get_new_notifs(worker)
    assert "victim" not in worker._recving_transfers  # before: a finished receive again
    assert worker.expired == [1]  # upstream's "Unrecognized request" branch


def test_send_hold_keeps_blocks_under_a_write_until_its_decode_stops_waiting():
    """The hold gave up after the lease (30 s) while the decode still waited for the WRITE (its
    write-by time + 5 s): the blocks were freed under a running WRITE, which could then copy
    another request's KV into a decode that used it. A decode's stated time is a peer's value:
    bounded by MAX_HOLD_S."""
    import time as clock

    from pd_plugins.connectors.vllm.pd_nixl_guards import MAX_HOLD_S, WRITE_BY_KEY, WriteGate

    worker = FakePushWorker()
    gate = WriteGate(worker)
    for request_id, write_by in (("slow", clock.time() + 100), ("far", clock.time() + 1e9),
                                 ("upstream-decode", None)):
        worker._reqs_to_send[request_id] = clock.perf_counter() + 60
        worker._reqs_to_process.add(request_id)
        worker._do_start_push_kv(request_id, [[1]],
                                 {WRITE_BY_KEY: write_by} if write_by else {})
    hold = SendHold(max_hold_s=30.0, decode_deadline=gate.decode_deadline)
    writing = {"slow", "far", "upstream-decode"}
    sending = set(writing)
    assert hold.settle(sending, in_flight=writing, now=0.0) == writing
    sending = set()
    hold.settle(sending, in_flight=writing, now=31.0)
    assert sending == {"upstream-decode"}  # states no write-by time: the lease bounds it
    sending = set()
    hold.settle(sending, in_flight=writing, now=104.0)
    assert sending == set()  # the decode waits until its write-by time + 5 s
    hold.settle(sending, in_flight=writing, now=106.0)
    assert sending == {"slow"}
    sending = set()
    hold.settle(sending, in_flight=writing, now=MAX_HOLD_S + 1)
    assert sending == {"far"}
