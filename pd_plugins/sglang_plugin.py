"""Entry point `sglang.srt.plugins`.

SGLang loads it (allow-list: SGLANG_PLUGINS). The pd-nixl and pd-shm transfer backends are not
implemented yet (SGLang integration issue); until then this hook registers nothing and says so.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("pd_plugins")

SGLANG_BACKENDS: tuple[str, ...] = ()


def register() -> list[str]:
    """Register pd-plugins transfer backends with SGLang; returns the names registered."""
    if not SGLANG_BACKENDS:
        logger.info("pd-plugins: no SGLang transfer backends in this release")
    return list(SGLANG_BACKENDS)
