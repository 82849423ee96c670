"""Entry point `sglang.srt.plugins` (SGLang loads it; allow-list: SGLANG_PLUGINS=pd_plugins).

Registers the pd-plugins transfer backends, selected with `--disaggregation-transfer-backend`:
`pd-shm` (the shared-memory KV pool). The registration itself is a version-checked patch
(patches/sglang_backends.py): SGLang has no backend registry.
"""

from __future__ import annotations


def register() -> list[str]:
    """Register pd-plugins transfer backends with SGLang; returns the names registered."""
    from pd_plugins.patches.sglang_backends import register as register_backends

    return register_backends()
