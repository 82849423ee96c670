"""Register pd-plugins transfer backends with SGLang, which has no backend registry.

Three small steps, through SGLang's own plugin hooks (sglang.srt.plugins):
1. `add_disagg_transfer_backend_choices`: `--disaggregation-transfer-backend` accepts our names;
2. members added to the fixed `TransferBackend` Enum, so `TransferBackend("pd-shm")` resolves;
3. an AROUND hook on `disaggregation.utils.get_kv_class` (HookRegistry also rebinds the
   `from ... import get_kv_class` copies in prefill.py, decode.py, disagg_service.py): our
   classes for our members, SGLang's own answer for everything else.
Checked against exactly the SGLang releases in CHECKED_VERSIONS: the ones tests/sglang's contract
test (test_sglang_contract.py: SGLang's own scheduler queues over our classes) has run against. Any
other release, a pre-release or post-release of one included, registers nothing and says so, and
SGLang then refuses `--disaggregation-transfer-backend pd-shm|pd-nixl` at startup as an invalid
choice: the backends rely on SGLang's queue internals, which change between releases (0.5.23's
decode queue reads `prefill_info_table` of every KV manager, for example).
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import PackageNotFoundError, version

logger = logging.getLogger("pd_plugins")

# exactly the releases the contract test has passed on; add one only after it passes there
CHECKED_VERSIONS = ("0.5.23",)
# backend name -> Enum member name, module with CLASSES {"manager", "sender", ...}
BACKENDS = {"pd-shm": ("PD_SHM", "pd_plugins.connectors.sglang.pd_shm"),
            "pd-nixl": ("PD_NIXL", "pd_plugins.connectors.sglang.pd_nixl")}


def sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def version_supported(found: str | None) -> bool:
    """A checked release exactly, a local "+..." build tag aside (pip's ==0.5.23 takes those)."""
    return found is not None and found.split("+", 1)[0] in CHECKED_VERSIONS


def _add_enum_member(enum_cls, name: str, value: str):
    """Add a member to an existing Enum class (Enum has no public way; 3.11's internals)."""
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    setattr(enum_cls, name, member)  # before it is a member: EnumType refuses to rebind members
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


_registered: list[str] | None = None  # once per process: a second AROUND hook would wrap ours


def register() -> list[str]:
    """Make our backends selectable; returns the names registered ([] if SGLang is unchecked).
    Idempotent: SGLang's load_plugins() runs it in every process, and so may a user's code."""
    global _registered
    if _registered is not None:
        return _registered
    found = sglang_version()
    if not version_supported(found):
        logger.warning("pd-plugins: SGLang %s is not a checked release (checked: %s): no "
                       "pd-plugins transfer backends registered, so SGLang refuses "
                       "`--disaggregation-transfer-backend %s` as an invalid choice",
                       found or "(not installed)", ", ".join(CHECKED_VERSIONS),
                       "|".join(BACKENDS))
        return []
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    add_disagg_transfer_backend_choices(
        [name for name in BACKENDS if name not in DISAGG_TRANSFER_BACKEND_CHOICES])
    ours = {_add_enum_member(utils.TransferBackend, member, name): module
            for name, (member, module) in BACKENDS.items()}

    def get_kv_class(original, transfer_backend, class_type):
        module = ours.get(transfer_backend)
        if module is None or class_type == utils.KVClassType.KVARGS:
            return original(transfer_backend, class_type)
        return importlib.import_module(module).CLASSES[class_type.value]

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class,
                          HookType.AROUND)
    logger.info("pd-plugins: SGLang %s transfer backends registered: %s", found, list(BACKENDS))
    _registered = list(BACKENDS)
    return _registered
