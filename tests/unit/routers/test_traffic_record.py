"""The traffic record's writer (routers/traffic_record.py): lines, overflow, rotation, file mode."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pd_plugins.routers.config import ConfigError, RouterConfig, TrafficRecordSpec, config_from_mapping
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.proxy import Proxy
from pd_plugins.routers.traffic_record import Measured, TrafficRecorder


def info(tokens: int = 40, keys: int = 2, **kw) -> RequestInfo:
    return RequestInfo(prompt_tokens=tokens, block_keys=list(range(1, keys + 1)), **kw)


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_a_full_queue_drops_and_counts_never_blocks(tmp_path):
    rec = TrafficRecorder(TrafficRecordSpec(path=str(tmp_path / "r.jsonl"), queue_size=2))
    for i in range(5):  # the writer is not started: nothing drains the queue
        rec.record("m", info(), 16, Measured(float(i)), 200, None)
    assert rec.counts["dropped"] == 3
    registry = CollectorRegistry()
    registry.register(rec.collector())
    assert b'pd_router_traffic_records_total{event="dropped"} 3.0' in generate_latest(registry)
    rec.start()
    rec.close()
    assert [r["t"] for r in read(tmp_path / "r.jsonl")] == [0.0, 1.0]
    assert rec.counts["written"] == 2


def test_lines_hold_the_record_format_and_no_more(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("")
    os.chmod(path, 0o644)  # an existing file is made private too
    rec = TrafficRecorder(TrafficRecordSpec(path=str(path), max_block_keys=3))
    rec.start()
    served = Measured(100.5, decision="local", decode="http://d", ttft_s=0.1, tpot_s=0.01,
                      e2e_s=0.3, output_tokens=21)
    rec.record("llama", info(tokens=100, keys=6, session_id="s1", turn=2), 16, served, 200, 2)
    whole = Measured(101.0, decision="disaggregated", prefill="http://p", decode="http://d",
                     e2e_s=0.2, answer=b'{"usage": {"completion_tokens": 7}}')
    rec.record("llama", info(max_tokens=9), 16, whole, 200, None)
    rec.record("llama", info(max_tokens=9), 16, Measured(102.0, decision="rejected"), 429, None)
    rec.record("llama", info(), 16, Measured(103.0, answer=b"not json"), 502, None)
    rec.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    a, b, c, d = read(path)
    assert a == {"t": 100.5, "model": "llama", "input_tokens": 100, "output_tokens": 21,
                 "block_keys": [1, 2, 3], "block_size": 16, "session": "s1", "turn": 2,
                 "decision": "local", "prefill": None, "decode": "http://d", "ttft_s": 0.1,
                 "tpot_s": 0.01, "e2e_s": 0.3, "status": 200}
    assert b["output_tokens"] == 7 and b["turn"] is None and b["prefill"] == "http://p"
    assert c["decision"] == "rejected" and c["output_tokens"] == 9 and c["status"] == 429
    assert d["decision"] == "failed" and d["output_tokens"] == 0  # no usage, no max_tokens


def test_rotation_keeps_backups_under_max_bytes(tmp_path):
    path = tmp_path / "r.jsonl"
    rec = TrafficRecorder(TrafficRecordSpec(path=str(path), max_bytes=4096, backups=2))
    rec.start()
    for i in range(200):
        rec.record("m", info(keys=10), 16, Measured(float(i)), 200, None)
    rec.close()
    names = sorted(os.listdir(tmp_path))
    assert names == ["r.jsonl", "r.jsonl.1", "r.jsonl.2"]
    assert rec.counts["rotations"] >= 3
    ts = [r["t"] for name in ("r.jsonl.2", "r.jsonl.1", "r.jsonl") for r in read(tmp_path / name)]
    assert ts == sorted(ts) and ts[-1] == 199.0  # oldest first, the newest kept, none repeated
    assert all(os.path.getsize(tmp_path / n) <= 4096 for n in names)


def test_no_backups_truncates(tmp_path):
    path = tmp_path / "r.jsonl"
    rec = TrafficRecorder(TrafficRecordSpec(path=str(path), max_bytes=4096, backups=0))
    rec.start()
    for i in range(100):
        rec.record("m", info(), 16, Measured(float(i)), 200, None)
    rec.close()
    assert os.listdir(tmp_path) == ["r.jsonl"] and read(path)[-1]["t"] == 99.0


def test_a_record_file_deleted_under_the_writer_is_made_again(tmp_path):
    # an operator frees space by deleting the file: the writer had filled the deleted file (the
    # space never freed) and then, at its rotation, been left with a closed file
    import time

    path = tmp_path / "r.jsonl"
    rec = TrafficRecorder(TrafficRecordSpec(path=str(path), max_bytes=4096, backups=1))
    rec.start()
    rec.record("m", info(), 16, Measured(0.0), 200, None)
    for _ in range(200):
        if path.exists() and path.stat().st_size:
            break
        time.sleep(0.01)
    path.unlink()
    for i in range(1, 200):  # past max_bytes: a rotation of the deleted file
        rec.record("m", info(keys=10), 16, Measured(float(i)), 200, None)
    rec.close()
    assert read(path)[-1]["t"] == 199.0  # the newest records are in a file at the path again
    assert rec.counts["write_errors"] == 0


# The disk fills up in the middle of a line (RLIMIT_FSIZE stands in for ENOSPC: a write past it
# is cut short, the next fails with EFBIG), then space comes back. A process of its own: the limit
# would hold for every file the test run writes.
DISK_FULL_SCRIPT = """
import json, os, resource, signal, sys, time
from pd_plugins.routers.config import TrafficRecordSpec
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.traffic_record import Measured, TrafficRecorder

path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
def one(rec, i):
    rec.record("m", RequestInfo(prompt_tokens=100 + i, block_keys=[11, 22, 33]), 16,
               Measured(float(i)), 200, None)
first = TrafficRecorder(TrafficRecordSpec(path=path))  # three lines already there
first.start()
for i in range(3):
    one(first, i)
first.close()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 50, hard))
rec = TrafficRecorder(TrafficRecordSpec(path=path))
for i in range(3, 6):  # queued before the writer starts: one batch of ~600 bytes, 50 fit
    one(rec, i)
rec.start()
for _ in range(1000):
    if rec.counts["write_errors"]:
        break
    time.sleep(0.01)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
for i in range(6, 9):
    one(rec, i)
rec.close()
print(json.dumps(rec.counts))
"""


@pytest.mark.processes
def test_a_batch_that_fails_part_way_leaves_whole_lines_and_counts_only_them(tmp_path):
    path = tmp_path / "r.jsonl"
    run = subprocess.run([sys.executable, "-c", DISK_FULL_SCRIPT, str(path)], capture_output=True,
                         text=True, timeout=60, cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, run.stderr
    counts = json.loads(run.stdout)
    assert [r["t"] for r in read(path)] == [0.0, 1.0, 2.0, 6.0, 7.0, 8.0]  # the failed batch gone
    assert counts["written"] == 3 and counts["write_errors"] == 1  # the second recorder's


def test_config_checks_the_record_spec():
    ok = config_from_mapping({"decode": [{"url": "http://d"}],
                              "traffic_record": {"path": "/tmp/x.jsonl"}}, "test")
    assert isinstance(ok, RouterConfig) and ok.traffic_record.max_bytes == 64 * 1024 * 1024
    assert ok.traffic_record.backups == 3 and ok.traffic_record.max_block_keys == 256
    for bad in ({"path": "/tmp/x", "max_bytes": 10}, {"path": "/tmp/x", "backups": -1},
                {"path": "/tmp/x", "queue_size": 0}):
        try:
            config_from_mapping({"decode": [{"url": "http://d"}], "traffic_record": bad}, "test")
        except ConfigError as exc:
            assert "traffic_record" in str(exc)
        else:
            raise AssertionError(f"accepted {bad}")


def test_the_flag_sets_the_path_and_keeps_the_yaml_limits(tmp_path):
    from pd_plugins.routers.cli import build_parser, config_from_args
    yaml_file = tmp_path / "router.yaml"
    yaml_file.write_text("traffic_record: {path: /elsewhere.jsonl, backups: 1}\n")
    args = build_parser().parse_args(["--decode", "http://127.0.0.1:9", "--config", str(yaml_file),
                                      "--traffic-record", str(tmp_path / "t.jsonl")])
    record = config_from_args(args).traffic_record
    assert record.path == str(tmp_path / "t.jsonl") and record.backups == 1


def test_requests_are_listed_in_flight_until_recorded_oldest_first_and_bounded(tmp_path, monkeypatch):
    from pd_plugins.routers import traffic_record

    rec = TrafficRecorder(TrafficRecordSpec(path=str(tmp_path / "r.jsonl"), max_block_keys=3))
    running = [Measured(float(i)) for i in range(4)]
    for i, m in enumerate(running):
        rec.started("a" if i < 3 else "b", info(tokens=64, keys=4, max_tokens=10), 16, m)
    running[2].phase, running[2].streamed = "answer", 5
    listed = rec.in_flight(None, limit=10, max_keys=100)
    assert [e["t"] for e in listed["requests"]] == [0.0, 1.0, 2.0, 3.0] and listed["total"] == 4
    assert listed["requests"][2] == {
        "t": 2.0, "model": "a", "input_tokens": 64, "max_tokens": 10, "block_keys": [1, 2, 3],
        "block_size": 16, "session": None, "phase": "answer", "output_tokens": 5, "stream": False}
    assert listed["requests"][0]["phase"] == "queued" and listed["requests"][0]["output_tokens"] == 0
    # a model's, the oldest `limit`, and the block keys within their budget, oldest first
    assert [e["t"] for e in rec.in_flight("b", 10, 100)["requests"]] == [3.0]
    some = rec.in_flight("a", 2, 4)
    assert some["total"] == 3 and [len(e["block_keys"]) for e in some["requests"]] == [3, 1]
    rec.record("a", info(), 16, running[1], 200, None)  # ended: no longer in flight
    assert [e["t"] for e in rec.in_flight(None, 10, 100)["requests"]] == [0.0, 2.0, 3.0]
    monkeypatch.setattr(traffic_record, "MAX_IN_FLIGHT", 3)  # full: listed no more, counted
    rec.started("a", info(), 16, Measured(9.0))
    assert rec.in_flight(None, 10, 100)["total"] == 3 and rec.counts["unlisted"] == 1


def test_requests_are_recorded_under_their_model_group_not_the_clients_spelling(tmp_path):
    """The unnamed group is "" in the record (as in /admin/calibration) whatever model a client
    names; a named group records its own name."""
    async def served(http, request, path):
        return types.SimpleNamespace(status=200)

    path = tmp_path / "r.jsonl"
    rec = TrafficRecorder(TrafficRecordSpec(path=str(path)))
    rec.start()

    async def go():
        for group in ("", "llama"):
            proxy = Proxy.__new__(Proxy)  # serve() reads only these
            proxy.recorder, proxy.model, proxy.sessions = rec, group, None
            proxy.ctx, proxy._serve = types.SimpleNamespace(block_size=16), served
            for client_model in ("llama", "meta-llama/Llama-3.1-8B", None):
                request = types.SimpleNamespace(model=client_model, info=info(), deferred=None)
                await proxy.serve({}, request, "/v1/completions")

    asyncio.run(go())
    rec.close()
    assert [r["model"] for r in read(path)] == [""] * 3 + ["llama"] * 3
