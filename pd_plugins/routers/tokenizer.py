"""Optional tokenizer, so text prompts get exact token-block keys (`--tokenizer PATH`).

Uses the `tokenizers` library on a local tokenizer.json (a model directory or the file itself);
no network, no transformers import.

The function returned also carries `off_loop` (the same tokens from encode_batch, which releases
the GIL: request.py runs long prompts through it on a worker thread, where encode would hold the
event loop) and `max_token_chars`: at most how many characters of a prompt one token covers, where
that is sure (else None), so that a prompt too long for the context is refused by its length
alone (request.py). It is sure for byte-level BPE with no normalizer (one can compose or drop
characters), pre-tokenizers that keep every character, and no added token that strips the
whitespace around it: every byte of the text is then covered by tokens, each of which spells at
most its own length in bytes, so tokens >= characters / max_token_chars.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from pd_plugins.routers.config import ConfigError


def load_tokenizer(path: str) -> Callable[[str], list[int]]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the `tokenizers` package (pip install tokenizers)") from None
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"tokenizer: no tokenizer.json at {path}")
    tokenizer = Tokenizer.from_file(str(file))

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=True).ids

    def off_loop(text: str) -> list[int]:
        return tokenizer.encode_batch([text], add_special_tokens=True)[0].ids

    tokenize.off_loop = off_loop  # type: ignore[attr-defined]
    tokenize.max_token_chars = max_token_chars(tokenizer)  # type: ignore[attr-defined]
    return tokenize


# pre-tokenizers that split without dropping a character (unless behavior "Removed")
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation"}


def max_token_chars(tokenizer) -> int | None:
    """See the module's docstring: None where a token may stand for more characters than it
    spells."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return None
    pre = spec.get("pre_tokenizer") or {}
    parts = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    if not any(p.get("type") == "ByteLevel" for p in parts):  # no unknown token: every byte has one
        return None
    if any(p.get("type") not in KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
           for p in parts):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return None  # it would cover the whitespace next to it, however long
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(map(len, vocab)) if vocab else None
