"""Block keys: a chained hash over each full block of a prompt's tokens.

The same chaining vLLM uses for its prefix cache, with our own hash, so the router, the pool
connectors and the mock agree on which prefix a block holds without depending on the engine's
hash algorithm or seed. Hashes of int tuples do not depend on PYTHONHASHSEED, so every process
computes the same keys.
"""

from __future__ import annotations

from typing import Sequence

ROOT_KEY = 0x9E3779B97F4A7C15  # the parent of a prompt's first block


def block_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """Chained keys of every full block of `tokens` (a partial last block has no key)."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        keys.append(parent)
    return keys


def text_block_keys(text: str, block_size: int, chars_per_token: int = 4) -> list[int]:
    """Approximate keys for a text prompt when no tokenizer is configured (string hashes are
    per process: only for keys one process computes and compares)."""
    width = block_size * chars_per_token
    keys, parent = [], ROOT_KEY
    for start in range(0, len(text) - width + 1, width):
        parent = hash((parent, text[start:start + width]))
        keys.append(parent)
    return keys
