"""Scoring with expert signatures (ELDR): how close a request's experts are to a decode worker's.

The signature itself (building, wire form) is shared vocabulary: pd_plugins/vocab/expert_signature.py.
Similarity is the mean over layers of the cosine between the dequantised histograms; a decode
worker's footprint is the sum of its running requests' histograms.
"""

from __future__ import annotations

import numpy as np


def similarity(request: np.ndarray, footprint: np.ndarray) -> float:
    """Mean over layers of the cosine between two [layers, experts] histograms (0 if either is
    empty or the shapes differ: signatures of another model say nothing)."""
    if request.shape != footprint.shape:
        return 0.0
    norms = np.linalg.norm(request, axis=1) * np.linalg.norm(footprint, axis=1)
    dots = np.einsum("le,le->l", request, footprint)
    valid = norms > 0
    if not valid.any():
        return 0.0
    return float((dots[valid] / norms[valid]).sum() / request.shape[0])


class ExpertFootprint:
    """One decode worker's running requests' histograms, summed (added when a request is
    dispatched there, removed when it ends)."""

    __slots__ = ("total", "count")

    def __init__(self) -> None:
        self.total: np.ndarray | None = None
        self.count = 0

    def add(self, histogram: np.ndarray) -> None:
        if self.total is None or self.total.shape != histogram.shape:
            self.total, self.count = histogram.astype(np.float64), 1
            return
        self.total += histogram
        self.count += 1

    def remove(self, histogram: np.ndarray) -> None:
        if self.total is None or self.total.shape != histogram.shape:
            return
        self.count -= 1
        if self.count <= 0:
            self.total, self.count = None, 0
            return
        np.subtract(self.total, histogram, out=self.total)
        np.maximum(self.total, 0.0, out=self.total)  # float drift


def locality_band(similarities: list[float], tau: float) -> list[int]:
    """Indices of the workers within `tau` of the best match (ELDR's locality band); the
    caller picks the least loaded among them. tau = 0 is strict affinity."""
    if not similarities:
        return []
    best = max(similarities)
    return [i for i, s in enumerate(similarities) if s >= best - tau]
