"""Clients that leave, clients that read slowly, and workers that are added while serving.

A client that disconnects cancels the legs at once (the engine sees its connection close), a
client that does not read its answer is dropped after `timeouts.client_write_s` without counting
against the decode worker, and a worker added through the admin API takes no request before a
health probe passed (a worker that accepts connections and never answers gets none).
"""

from __future__ import annotations

import socket
import threading
import time

import requests

from pd_plugins.testing.raw_client import sample, send_raw
from pd_plugins.testing.router_harness import MockEngineProcess
from tests.router.conftest import LONG_PROMPT, deployment, mocks, wait_until

TOKEN = "lifecycle-admin-token"


def in_flight(router) -> float:
    return sample(router.metrics(), "pd_router_worker_in_flight")


def test_client_leaving_mid_prefill_cancels_the_prefill_leg_at_once():
    prefills, decodes = mocks(prefill_args=("--ttft-ms", "4000"))
    with deployment(prefills, decodes) as router:
        sock = send_raw(router.url, {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 4})
        wait_until(lambda: prefills[0].stats()["running"] == 1, timeout=10, what="the prefill leg")
        sock.close()
        left = time.monotonic()
        wait_until(lambda: prefills[0].stats()["cancelled"] == 1, timeout=3,
                   what="the prefill to see its leg closed")
        assert time.monotonic() - left < 2.0  # not the 4 s the prefill would have run on (slack: 2 busy cores)
        stats = prefills[0].stats()
        assert stats["rooms_held"] == 0 and stats["running"] == 0  # no KV left behind
        assert decodes[0].stats()["requests"] == 0  # and no decode leg for a client that left
        wait_until(lambda: in_flight(router) == 0, timeout=5, what="in-flight counts back to 0")
        metrics = router.metrics()
        assert sample(metrics, "pd_router_client_gone_total", stage="prefill", how="disconnect") == 1
        # the router's own behaviour, not a worker failure: the prefill stays in, and serves
        assert sample(metrics, "pd_router_worker_healthy", role="prefill") == 1
        resp = requests.post(router.url + "/v1/completions", timeout=30, json={
            "model": "mock", "prompt": LONG_PROMPT, "max_tokens": 2})
        assert resp.status_code == 200, resp.text


def test_client_leaving_mid_decode_cancels_the_decode_leg_at_once():
    # A non-streaming answer: nothing is written to the client before the decode finishes, so
    # only the disconnect itself can tell the router (5 s of decoding at 100 ms a token).
    prefills, decodes = mocks(decode_args=("--tpot-ms", "100"))
    with deployment(prefills, decodes) as router:
        sock = send_raw(router.url, {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 50})
        wait_until(lambda: decodes[0].stats()["running"] == 1, timeout=10, what="the decode leg")
        sock.close()
        left = time.monotonic()
        wait_until(lambda: decodes[0].stats()["cancelled"] == 1, timeout=4,
                   what="the decode to see its leg closed")
        assert time.monotonic() - left < 2.0  # not the 5 s the decode would have run on
        assert prefills[0].stats()["rooms_held"] == 0  # the decode had read the KV
        wait_until(lambda: in_flight(router) == 0, timeout=5, what="in-flight counts back to 0")
        metrics = router.metrics()
        assert sample(metrics, "pd_router_client_gone_total", stage="decode", how="disconnect") == 1
        assert sample(metrics, "pd_router_requests_total", outcome="error") == 0


def test_a_client_that_does_not_read_is_dropped_and_not_blamed_on_the_decode():
    # failure_threshold 1: a single failure put on the decode would take it out.
    # 200k tokens (~30 MB of events): more than every socket buffer on the way holds, so the
    # decode is still streaming when the router gives up on the client
    long_context = ("--max-model-len", "300000")
    prefills, decodes = mocks(prefill_args=long_context, decode_args=long_context)
    config = {"timeouts": {"client_write_s": 2.0, "decode_idle_s": 1.0},
              "health": {"interval_s": 30, "timeout_s": 2, "failure_threshold": 1}}
    with deployment(prefills, decodes, config=config) as router:
        sock = send_raw(router.url, {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 200_000,
                                 "stream": True}, rcvbuf=4096)
        try:  # the client never reads: the router's writes stall once the buffers are full
            wait_until(lambda: sample(router.metrics(), "pd_router_client_gone_total",
                                      how="write_timeout") == 1,
                       timeout=15, what="the router to time the write out")
            wait_until(lambda: decodes[0].stats()["running"] == 0, timeout=5,
                       what="the decode leg to be closed")
        finally:
            sock.close()
        assert decodes[0].stats()["cancelled"] == 1  # aborted, not run to the end
        metrics = router.metrics()
        assert sample(metrics, "pd_router_worker_healthy", role="decode") == 1
        assert sample(metrics, "pd_router_requests_total", outcome="error") == 0
        assert "failed mid-stream" not in router.log_path.read_text()
        wait_until(lambda: in_flight(router) == 0, timeout=5, what="in-flight counts back to 0")
        resp = requests.post(router.url + "/v1/completions", timeout=30, json={
            "model": "mock", "prompt": LONG_PROMPT, "max_tokens": 2})
        assert resp.status_code == 200, resp.text


class SilentServer:
    """Accepts connections, reads what comes, never answers: a hung engine. Keeps the first
    line and headers of every request it is sent."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[str] = []
        self._conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            try:
                piece = conn.recv(65536)
            except OSError:
                return
            if not piece:
                return
            data += piece
        self.requests.append(data.split(b"\r\n\r\n")[0].decode(errors="replace"))

    def routed(self) -> list[str]:
        """Requests that were not health probes."""
        return [r for r in self.requests if r.startswith("POST")
                and "pd-router-canary" not in r]

    def close(self) -> None:
        self._stop = True
        try:  # on Linux close() alone leaves the accept thread blocked for good
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for conn in self._conns:
            conn.close()


def test_an_admin_added_worker_takes_no_request_before_a_probe_passed():
    prefills, decodes = mocks()
    hung = SilentServer()
    with deployment(prefills, decodes, "--policy", "round_robin",
                    env={"PD_ROUTER_ADMIN_TOKEN": TOKEN}) as router:
        answers: list[requests.Response] = []
        adding = threading.Thread(target=lambda: answers.append(requests.post(
            router.url + "/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"},
            json={"role": "decode", "worker": {"url": hung.url}}, timeout=30)))
        try:
            adding.start()
            wait_until(lambda: hung.requests, timeout=10, what="the first health probe")
            # The probe now waits out its timeout (2 s): round robin must not pick the new worker.
            for _ in range(8):
                t0 = time.monotonic()
                resp = requests.post(router.url + "/v1/completions", timeout=10, json={
                    "model": "mock", "prompt": LONG_PROMPT, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
                assert time.monotonic() - t0 < 2
            adding.join(30)
            assert answers and answers[0].status_code == 200 and answers[0].json()["healthy"] is False
            assert hung.routed() == []
            assert sample(router.metrics(), "pd_router_worker_healthy", url=hung.url) == 0
        finally:
            hung.close()


def test_an_admin_added_worker_serves_once_its_probe_passed():
    prefills, decodes = mocks()
    spare = MockEngineProcess("decode-new", role="decode")
    with deployment(prefills, decodes, "--policy", "round_robin",
                    env={"PD_ROUTER_ADMIN_TOKEN": TOKEN}) as router:
        try:
            spare.start().wait_healthy(30)
            added = requests.post(router.url + "/admin/workers",
                                  headers={"Authorization": f"Bearer {TOKEN}"},
                                  json={"role": "decode", "worker": {"url": spare.url}}, timeout=30)
            assert added.status_code == 200 and added.json()["healthy"] is True
            for _ in range(4):
                resp = requests.post(router.url + "/v1/completions", timeout=10, json={
                    "model": "mock", "prompt": LONG_PROMPT, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
            assert spare.stats()["remote_decodes"] >= 1
        finally:
            spare.stop()
