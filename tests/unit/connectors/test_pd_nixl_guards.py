"""PdNixlConnector's guards, on their own (the e2e tests run them inside real vLLM engines)."""

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
