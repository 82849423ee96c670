"""Scheduler -> worker lookups over real ZMQ ipc sockets (transfer/lookup_channel.py)."""

import time
import uuid

from pd_plugins.transfer.lookup_channel import LookupClient, LookupServer, lookup_address


def address() -> str:
    return lookup_address(f"test-{uuid.uuid4().hex}")


def test_the_worker_answers_with_its_store_s_count():
    addr = address()
    seen = []
    server = LookupServer(addr, lambda tokens: seen.append(list(tokens)) or len(tokens) // 32 * 32)
    client = LookupClient(addr, timeout_s=5)
    try:
        assert client.lookup(list(range(70))) == 64
        assert client.lookup([]) == 0
        assert seen == [list(range(70)), []]
    finally:
        client.close()
        server.close()


def test_no_worker_is_a_miss_within_the_timeout_and_the_client_recovers():
    addr = address()
    client = LookupClient(addr, timeout_s=0.2)
    start = time.monotonic()
    assert client.lookup([1, 2, 3]) == 0
    assert time.monotonic() - start < 2 and client.timeouts == 1
    server = LookupServer(addr, lambda tokens: 7)  # the worker comes up later
    try:
        assert client.lookup([1, 2, 3]) == 7  # a fresh socket: the late reply is not mixed in
    finally:
        client.close()
        server.close()


def test_a_failing_store_answers_zero_and_keeps_serving():
    addr = address()
    calls = []

    def lookup(tokens):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("backend down")
        return 5

    server = LookupServer(addr, lookup)
    client = LookupClient(addr, timeout_s=5)
    try:
        assert client.lookup([1]) == 0
        assert client.lookup([1]) == 5
    finally:
        client.close()
        server.close()


def test_an_oversized_lookup_is_dropped_and_the_worker_keeps_serving(tmp_path, monkeypatch):
    import os
    import stat

    from pd_plugins.transfer import lookup_channel

    monkeypatch.setenv("PD_PRIVATE_DIR", str(tmp_path / "private"))
    monkeypatch.setattr(lookup_channel, "MAX_LOOKUP_BYTES", 1000)
    addr = address()
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o700
    server = LookupServer(addr, lambda tokens: len(tokens))
    client = LookupClient(addr, timeout_s=0.5)
    try:
        assert client.lookup(list(range(10_000))) == 0 and client.timeouts == 1  # dropped
        assert client.lookup([1, 2, 3]) == 3
    finally:
        client.close()
        server.close()
