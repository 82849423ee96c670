"""The mock's MoE routing, a fake for ELDR tests and benchmarks: token t picks expert t mod E in
every layer. Prefill answers carry it as an expert signature (`--moe-experts`); a modelled decode
reads the same experts (`--latency-model` with a MoE preset)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from pd_plugins.vocab.expert_signature import ExpertSignature

_encode = msgspec.json.Encoder().encode


def mock_expert_counts(tokens: list[int], layers: int, experts: int) -> np.ndarray:
    """[layers, experts] counts of the tokens' choices."""
    counts = np.zeros((layers, experts))
    np.add.at(counts, (slice(None), np.asarray(tokens, dtype=np.int64) % experts), 1)
    return counts


def mock_expert_signature(body: dict[str, Any], layers: int, experts: int) -> ExpertSignature:
    """The prefill's answer under the mock routing; a text prompt's bytes stand in for tokens."""
    prompt = body.get("prompt")
    tokens = prompt if isinstance(prompt, list) else list(_encode(prompt or body.get("messages")))
    return ExpertSignature.from_counts(mock_expert_counts(tokens, layers, experts))


def mock_expert_pick(tokens: list[int], layers: int, experts: int, top_k: int) -> np.ndarray:
    """The decode's view of the same routing, for the engine model's expert-aware step time: the
    chance that one of the request's tokens picks each expert (top_k per token)."""
    counts = mock_expert_counts(tokens, layers, experts)
    return np.minimum(1.0, top_k * counts / max(1, len(tokens)))
