"""Shared fixtures: the real trace files (loaded once per run) and a tmp-file writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_plugins.workloads import TRACES, load_azure, load_mooncake


def _real(name: str) -> Path:
    try:
        path = TRACES[name]
    except FileNotFoundError as e:
        pytest.skip(f"trace files not available: {e}")
    if not path.is_file():
        pytest.skip(f"trace file {path} missing")
    return path


@pytest.fixture(scope="session")
def mooncake_conv():
    return load_mooncake(_real("mooncake_conv"))


@pytest.fixture(scope="session")
def azure_conv():
    return load_azure(_real("azure_conv"))


@pytest.fixture
def write(tmp_path):
    """write(name, text) -> path of a tmp file holding `text`."""
    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path
    return _write
