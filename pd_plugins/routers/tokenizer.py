"""Optional tokenizer, so text prompts get exact token-block keys (`--tokenizer PATH`).

Uses the `tokenizers` library on a local tokenizer.json (a model directory or the file itself);
no network, no transformers import.
"""

from __future__ import annotations

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

    return tokenize
