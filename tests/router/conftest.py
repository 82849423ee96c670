"""pd-router in front of pd-mock-engine processes (fakes of the engines: the router is what runs
for real here, over real HTTP). Each test gets its own ports; every process is stopped by PID."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import pytest

from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.router_harness import MockEngineProcess, RouterProcess

LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 8  # ~88 tokens: disaggregated
FAST_HEALTH = {"interval_s": 0.5, "timeout_s": 2, "failure_threshold": 2, "metrics_interval_s": 0.5}


def mocks(engine: str = "vllm", prefills: int = 1, decodes: int = 1, push: bool = False,
          prefill_args: tuple = (), decode_args: tuple = ()) -> tuple[list, list]:
    p = [MockEngineProcess(f"prefill{i}", role="prefill", engine=engine,
                           engine_id=f"p{i}" if push else None, args=prefill_args)
         for i in range(prefills)]
    d = [MockEngineProcess(f"decode{i}", role="decode", engine=engine, args=decode_args)
         for i in range(decodes)]
    return p, d


@contextlib.contextmanager
def deployment(prefills: list, decodes: list, *router_args: str, config: dict | None = None,
               env: dict | None = None) -> Iterator[RouterProcess]:
    # These tests need short prompts disaggregated (prefix_cache: from 16 uncached tokens); the
    # router's default policy prefills prompts under 1024 tokens on the decode worker.
    named = "--policy" in router_args or "policy" in (config or {})
    policy = () if named else ("--policy", "prefix_cache")
    router = RouterProcess("router", prefill=[p.worker_arg() for p in prefills],
                           decode=[d.worker_arg() for d in decodes],
                           args=("--log-format", "text", *policy, *router_args),
                           config={"health": FAST_HEALTH, **(config or {})}, env=env or {})
    everything = [*prefills, *decodes]
    try:
        start_all(everything, timeout=60)
        start_all([router], timeout=60)
        yield router
    finally:
        for proc in [router, *everything]:
            proc.stop(grace=5)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def completion_body():
    return {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 6}
