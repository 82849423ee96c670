"""The `pd-shm` SGLang backend with the real SGLang package (0.5.23, in .venv-sglang).

Each engine role is its own process (tests/sglang/sglang_roles.py) that uses SGLang's plugin
loader, argument parser, `get_kv_class` and KV lifecycle; real bytes move through a real
shared-memory pool and are checked page by page with SHA-256 digests. SGLang's engine itself
does not run on a CPU machine, so nothing here schedules a model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from pd_plugins.testing.processes import free_port
from pd_plugins.testing.sglang_env import REPO, SGLANG_PYTHON
from pd_plugins.transfer.shm_pool import remove_pool

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="no .venv-sglang: run `make bootstrap` (scripts/bootstrap.sh)")

KV_POLL_FAILED, KV_POLL_SUCCESS = 0, 4
PAGE_SIZE = 4  # tokens per page in sglang_roles.py


@pytest.fixture
def pool_env(tmp_path):
    path = f"/dev/shm/pd-test-sglang-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, "PD_SHM_POOL": path, "PD_SHM_POOL_GB": "0.05", "PD_SHM_HOLD_S": "30",
           "SGLANG_PLUGINS": "pd_plugins", "PYTHONWARNINGS": "ignore"}
    yield env
    remove_pool(path)


class Role:
    """One sglang_roles.py process; its JSON events read line by line."""

    def __init__(self, env: dict, role: str, spec: dict | None = None) -> None:
        args = [str(SGLANG_PYTHON), "-m", "tests.sglang.sglang_roles", role]
        if spec is not None:
            args.append(json.dumps(spec))
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)

    def next_event(self, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise AssertionError(f"no event from {self.proc.args[3]}; stderr:\n"
                             f"{self.proc.stderr.read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def roles():
    started: list[Role] = []

    def start(env, role, spec=None) -> Role:
        started.append(Role(env, role, spec))
        return started[-1]

    yield start
    for role in started:
        role.stop()


def test_sglang_accepts_and_resolves_the_backend(pool_env, roles):
    got = roles(pool_env, "registration").next_event()
    assert got["backend"] == "pd-shm"  # SGLang's own parser took the name
    assert got["classes"] == {"kvargs": "KVArgs", "manager": "PdShmKVManager",
                              "sender": "PdShmKVSender", "receiver": "PdShmKVReceiver",
                              "bootstrap_server": "PdShmKVBootstrapServer"}
    assert got["schedulers"] == {"prefill": "PdShmKVSender", "decode": "PdShmKVSender"}
    assert got["nixl_manager"] == "NixlKVManager"  # other backends untouched


def test_kv_moves_between_two_processes(pool_env, roles):
    port = free_port()
    pages, rooms = [3, 4, 5, 9, 10, 11], [(1 << 62) + 17, 424242]
    prefill = roles(pool_env, "prefill", {
        "bootstrap_port": port, "then_sleep_s": 120,
        "rooms": [{"room": rooms[0], "pages": pages, "chunks": 3, "aux_index": 2},
                  {"room": rooms[1], "pages": pages[:2], "chunks": 1, "aux_index": 3}]})
    assert prefill.next_event()["event"] == "ready"
    sent = [prefill.next_event(), prefill.next_event()]
    assert [s["state"] for s in sent] == [KV_POLL_SUCCESS] * 2, sent
    assert sent[0]["metric"]["transfer_total_bytes"] == len(pages) * 2 * 2 * 256  # layers, K+V

    # the whole room into other pages; then the second room after a cached first page
    whole = roles(pool_env, "decode", {"bootstrap_port": port, "room": rooms[0],
                                       "dest": [40, 41, 42, 50, 51, 52], "aux_index": 7})
    assert whole.next_event()["event"] == "bootstrapped"
    got = whole.next_event()
    assert got["state"] == KV_POLL_SUCCESS, got
    assert got["kv"] == sent[0]["kv"] and got["aux"] == sent[0]["aux"]
    # its 6 pages and manifest: hold ended, data kept; the other room's 2 + 1 are still held
    assert (got["pool_after"]["ready"], got["pool_after"]["held"]) == (7 + 3, 3)

    suffix = roles(pool_env, "decode", {"bootstrap_port": port, "room": rooms[1], "dest": [60],
                                        "prefix_len": PAGE_SIZE, "aux_index": 0})
    suffix.next_event()
    got = suffix.next_event()
    assert got["state"] == KV_POLL_SUCCESS, got
    assert got["kv"] == sent[1]["kv"][1:] and got["aux"] == sent[1]["aux"]


def test_the_swap_a_room_is_its_own_kv(pool_env, roles):
    """Two rooms' KV differ; each decode gets exactly its own room's pages."""
    port = free_port()
    prefill = roles(pool_env, "prefill", {
        "bootstrap_port": port, "then_sleep_s": 120,
        "rooms": [{"room": 5, "pages": [1, 2], "aux_index": 1},
                  {"room": 6, "pages": [1, 2], "aux_index": 1}]})
    prefill.next_event()
    five, six = prefill.next_event(), prefill.next_event()
    assert five["kv"] != six["kv"]
    for room, expected in ((6, six), (5, five)):
        decode = roles(pool_env, "decode", {"bootstrap_port": port, "room": room,
                                            "dest": [8, 9], "aux_index": 2})
        decode.next_event()
        got = decode.next_event()
        assert (got["kv"], got["aux"]) == (expected["kv"], expected["aux"])


def test_no_kv_in_time_fails_with_a_timeout(pool_env, roles):
    port = free_port()
    prefill = roles(pool_env, "prefill", {"bootstrap_port": port, "rooms": [],
                                          "then_sleep_s": 120})
    prefill.next_event()
    start = time.monotonic()
    decode = roles({**pool_env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "2"}, "decode",
                   {"bootstrap_port": port, "room": 99, "dest": [1], "aux_index": 0})
    decode.next_event()
    got = decode.next_event()
    assert got["state"] == KV_POLL_FAILED
    assert got["failure"].startswith("TimeoutError: room 99: no KV from the prefill")
    assert time.monotonic() - start < 60


def test_a_dead_prefill_fails_the_decode(pool_env, roles):
    port = free_port()
    prefill = roles(pool_env, "prefill", {"bootstrap_port": port, "rooms": [],
                                          "then_sleep_s": 120})
    prefill.next_event()
    decode = roles({**pool_env, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.3"}, "decode",
                   {"bootstrap_port": port, "room": 100, "dest": [1], "aux_index": 0})
    assert decode.next_event()["event"] == "bootstrapped"
    prefill.stop()  # SIGKILL: its bootstrap registry goes with it
    got = decode.next_event()
    assert got["state"] == KV_POLL_FAILED
    assert "ConnectionError" in got["failure"] and "is gone" in got["failure"]


def test_abort_ends_in_failed(pool_env, roles):
    port = free_port()
    prefill = roles(pool_env, "prefill", {
        "bootstrap_port": port, "then_sleep_s": 120,
        "rooms": [{"room": 3, "pages": [1], "aux_index": 0, "abort": True}]})
    prefill.next_event()
    sent = prefill.next_event()
    assert sent["state"] == KV_POLL_FAILED and "aborted" in sent["failure"]
    decode = roles(pool_env, "decode", {"bootstrap_port": port, "room": 3, "dest": [1],
                                        "aux_index": 0, "abort": True})
    decode.next_event()
    got = decode.next_event()
    assert got["state"] == KV_POLL_FAILED and "aborted" in got["failure"]


def test_bootstrap_to_nothing_fails_clearly(pool_env, roles):
    decode = roles({**pool_env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1"}, "decode",
                   {"bootstrap_port": free_port(), "room": 1, "dest": [1], "aux_index": 0,
                    "bootstrap_s": 30})
    got = decode.next_event()
    assert got["state"] == KV_POLL_FAILED
    assert "bootstrap timed out" in got["failure"] and "unreachable" in got["failure"]
