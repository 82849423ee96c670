"""What the SGLang role tests share: one interpreter with SGLang imported per test module, from
which every role process is forked (role_forkserver.py)."""

from __future__ import annotations

import os

import pytest

from pd_plugins.testing.sglang_env import REPO, SGLANG_PYTHON
from tests.sglang.role_forkserver import RoleForkServer


@pytest.fixture(scope="module")
def forkserver():
    """One interpreter with SGLang imported; every role process is forked from it."""
    server = RoleForkServer(SGLANG_PYTHON, REPO, {**os.environ, "PYTHONWARNINGS": "ignore"})
    yield server
    server.close()
