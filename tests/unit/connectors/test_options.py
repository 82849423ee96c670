"""Connector flags read from kv_connector_extra_config as users write them (JSON or strings)."""

from types import SimpleNamespace

import pytest

from pd_plugins.connectors.vllm.options import extra_flag, truthy


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), ("true", True), ("1", True), ("on", True),
    ("false", False), ("False", False), (" no ", False), ("0", False), ("off", False), (0, False),
    (1, True), ("", False),
])
def test_truthy(value, expected):
    assert truthy(value) is expected


def test_extra_flag_default_and_string_false():
    extra = {"expert_signatures": "false"}
    config = SimpleNamespace(get_from_extra_config=lambda name, default: extra.get(name, default))
    assert extra_flag(config, "expert_signatures") is False  # bool("false") would be True
    assert extra_flag(config, "keep_cpu_affinity", True) is True
    assert extra_flag(config, "other") is False
