"""Decode-side checks of kv_transfer_params (no engine imports; the `pd` section and leg flags
are in pd_plugins/vocab/transfer_params.py).

Two things cross the wire in a PD request's `kv_transfer_params`:
- the engine's own transfer fields (where the KV is: engine id, host, port, block ids), which a
  decode engine must check before trusting them;
- our `pd` section, added by the prefill engine, carrying what a router needs to route well.
"""

from __future__ import annotations

import math
from typing import Any

from pd_plugins.vocab.engines import TransferMode
from pd_plugins.vocab.transfer_params import PD_SECTION_KEY


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Upstream NIXL computes descriptor ids from block ids as int32 (np.asarray(..., np.int32)):
# a larger id raised OverflowError on the engine's main thread.
MAX_BLOCK_ID = 2**31 - 1


def _is_block_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_BLOCK_ID


def _is_block_id_list(value: Any) -> bool:
    """Block ids: a flat list of ints, or one list of ints per KV cache group (each below 2**31)."""
    if not isinstance(value, (list, tuple)):
        return False
    if all(_is_block_id(b) for b in value):
        return True
    return all(
        isinstance(group, (list, tuple)) and all(_is_block_id(b) for b in group)
        for group in value
    )


def _is_nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and value != ""


# field -> (check, what it must be). Push (prefill WRITEs) names the prefill engine and request;
# pull (decode READs) also names the exact blocks to read.
_PUSH_FIELDS: dict[str, tuple[Any, str]] = {
    "remote_engine_id": (_is_nonempty_str, "a non-empty string"),
    "remote_request_id": (_is_nonempty_str, "a non-empty string"),
    "remote_host": (_is_nonempty_str, "a non-empty string"),
    "remote_port": (lambda v: _is_int(v) and 0 < v < 65536, "a port number (1-65535)"),
    "tp_size": (lambda v: _is_int(v) and v > 0, "a positive integer"),
}
_PULL_FIELDS: dict[str, tuple[Any, str]] = {
    **_PUSH_FIELDS,
    "remote_block_ids": (_is_block_id_list,
                         "a list of block ids in [0, 2**31) (or one such list per group)"),
}
_REQUIRED_FIELDS = {"pull": _PULL_FIELDS, "push": _PUSH_FIELDS}
# Optional fields upstream reads unchecked too (a string in an arithmetic field kills a worker).
_OPTIONAL_FIELDS: dict[str, tuple[Any, str]] = {
    "dcp_size": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "pp_size": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "remote_num_tokens": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "remote_block_size": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "remote_blocks_expiry_time": (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        "a number (seconds since the epoch)"),
}


def malformed_params_error(params: Any) -> str | None:
    """Why a request's kv_transfer_params cannot be read at all (not a JSON object), or None.

    vLLM's API types the top-level field as a dict, but copies `vllm_xargs` (string, number or
    list values) into the same place unchecked, and upstream connectors then call `.get` on
    whatever is there: `""`, `0` or `[]` there raise inside the engine core and kill it."""
    if params is None or isinstance(params, dict):
        return None
    return f"kv_transfer_params must be a JSON object, got {type(params).__name__} {params!r:.80}"


def remote_prefill_error(params: dict[str, Any], mode: TransferMode = "pull") -> str | None:
    """Why these decode-side kv_transfer_params cannot be used, or None when they can.

    Only requests that ask to load remote KV (`do_remote_prefill`) are checked: anything else is
    served locally and never touches another engine's blocks.
    """
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    for field, (check, expected) in _REQUIRED_FIELDS[mode].items():
        if field not in params:
            return f"kv_transfer_params.{field} is missing"
        if not check(params[field]):
            return f"kv_transfer_params.{field} must be {expected}, got {params[field]!r}"
    for field, (check, expected) in _OPTIONAL_FIELDS.items():
        value = params.get(field)
        if value is not None and not check(value):
            return f"kv_transfer_params.{field} must be {expected}, got {value!r}"
    return None


def lease_check_of(params: dict[str, Any]) -> tuple[str, int, str] | None:
    """(host, port, prefill request id) to ask whether a pull read was on time; None if the
    prefill offers no lease check (not PdNixlConnector, or an unusable port)."""
    section = params.get(PD_SECTION_KEY)
    port = section.get("lease_check_port") if isinstance(section, dict) else None
    if not (_is_int(port) and 0 < port < 65536):
        return None
    host, request_id = params.get("remote_host"), params.get("remote_request_id")
    if not (_is_nonempty_str(host) and _is_nonempty_str(request_id)):
        return None
    return host, port, request_id


def asks_remote_decode(kv_transfer_params: Any) -> bool:
    """True for a PD prefill leg (the router asked the prefill to keep the KV for a decode)."""
    return isinstance(kv_transfer_params, dict) and bool(kv_transfer_params.get("do_remote_decode"))
