"""Connector options from vLLM's `kv_connector_extra_config`, as users write them (JSON or strings).

The option structs, their checks and their table are in transfer/options.py (SGLang's backends
read the same structs from the environment).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pd_plugins.transfer.options import from_extra_config, truthy

__all__ = ["extra_flag", "extra_options", "truthy"]

S = TypeVar("S")


def extra_options(cls: type[S], kv_transfer_config: Any, who: str) -> S:
    """`cls` (NixlOptions, ShmOptions, LMCacheOptions) from the config's extra keys."""
    get = getattr(kv_transfer_config, "get_from_extra_config", None)
    return from_extra_config(cls, get, who)


def extra_flag(kv_transfer_config, name: str, default: bool = False) -> bool:
    value = kv_transfer_config.get_from_extra_config(name, default)
    try:
        return truthy(value)
    except ValueError as exc:
        raise ValueError(f"kv_connector_extra_config.{name}: {exc}") from None
