"""Expert signatures (ELDR): which experts a request's prompt activated, per MoE layer, compactly.

A MoE decode step loads the weights of every distinct expert its batch routes to, so a decode
worker whose running requests use the same experts as a new one pays less to add it (ELDR,
arXiv 2607.00466: median TPOT -5.9% to -13.9% against the best load balancer). The prefill sees
which experts the prompt's tokens chose; that choice predicts the decode's.

A signature is a per-layer histogram of expert choices, normalised per layer and quantised to
2 bits per expert (its share of the layer's most used expert, rounded to thirds), packed four to
a byte: 48 layers x 128 experts fit in 1536 bytes (2048 characters of base64), as the `pd`
section carries it. Similarity is the mean over layers of the cosine between the dequantised
histograms; a decode worker's footprint is the sum of its running requests' histograms.

Engine-agnostic: numpy only. Scoring (similarity, a decode's footprint, the locality band) is
the router's: routers/policy/expert_signature.py.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

LEVELS = 3  # 2 bits: 0..3
SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


@dataclass(frozen=True)
class ExpertSignature:
    layers: int
    experts: int
    levels: np.ndarray  # [layers, experts] uint8 in 0..LEVELS

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def from_counts(cls, counts: np.ndarray, checked: bool = False) -> ExpertSignature:
        """From per-layer expert choice counts ([layers, experts], any non-negative numbers;
        `checked`: the caller built them so, as the capture does)."""
        counts = np.asarray(counts, dtype=np.float64)
        if not checked and (counts.ndim != 2 or (counts < 0).any()):
            raise ValueError("expert counts must be a non-negative [layers, experts] array")
        # share of the layer's most used expert (an unused layer: all 0), rounded: experts chosen
        # by a stray token or two read as unused (long prompts touch nearly every expert; what
        # tells topics apart is where most choices go)
        share = counts * (LEVELS / np.maximum(counts.max(axis=1, keepdims=True), 1e-300))
        return cls(counts.shape[0], counts.shape[1], np.rint(share).astype(np.uint8))

    @classmethod
    def from_topk(cls, topk_ids_per_layer: list[np.ndarray], experts: int) -> ExpertSignature:
        """From the top-k expert ids each MoE layer chose for the prompt's tokens."""
        counts = np.zeros((len(topk_ids_per_layer), experts), dtype=np.int64)
        for layer, ids in enumerate(topk_ids_per_layer):
            np.add.at(counts[layer], np.asarray(ids, dtype=np.int64).reshape(-1), 1)
        return cls.from_counts(counts)

    # -- wire form ----------------------------------------------------------------------------
    def encode(self) -> dict:
        flat = self.levels.reshape(-1)
        if flat.size % 4:
            flat = np.concatenate((flat, np.zeros(4 - flat.size % 4, np.uint8)))
        # four 2-bit levels per byte, the first in the lowest bits
        packed = np.bitwise_or.reduce(flat.reshape(-1, 4) << SHIFTS, axis=1)
        return {"layers": self.layers, "experts": self.experts,
                "levels": base64.b64encode(packed.tobytes()).decode()}

    @classmethod
    def decode(cls, wire: object) -> ExpertSignature:
        """From `encode()`'s form; ValueError for anything else (it comes over the network)."""
        if not isinstance(wire, dict):
            raise ValueError("an expert signature is an object")
        layers, experts, text = wire.get("layers"), wire.get("experts"), wire.get("levels")
        if not (isinstance(layers, int) and isinstance(experts, int) and isinstance(text, str)
                and 0 < layers <= 1024 and 0 < experts <= 4096):
            raise ValueError("an expert signature needs layers, experts and levels")
        try:
            packed = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"expert signature levels are not base64: {exc}") from None
        if packed.size != -(-layers * experts // 4):
            raise ValueError("expert signature levels do not match layers x experts")
        unpacked = ((packed[:, None] >> SHIFTS) & 3).reshape(-1)
        return cls(layers, experts, unpacked[:layers * experts].reshape(layers, experts))

    # -- comparing ----------------------------------------------------------------------------
    def histogram(self) -> np.ndarray:
        """Dequantised per-layer shares ([layers, experts] float)."""
        return self.levels.astype(np.float64) / LEVELS
