"""Reading `kv_connector_extra_config` values the way users write them."""

from __future__ import annotations

from typing import Any


def truthy(value: Any) -> bool:
    """A flag from JSON or a string: false, "false", "0", "no" and "off" are off."""
    return value if isinstance(value, bool) else str(value).strip().lower() not in (
        "0", "false", "no", "off", "")


def extra_flag(kv_transfer_config, name: str, default: bool = False) -> bool:
    return truthy(kv_transfer_config.get_from_extra_config(name, default))
