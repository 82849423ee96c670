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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_plugins.routers.policy.expert_signature import ExpertSignature


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
        weights = 1.0 / np.arange(1, s.topics + 1) ** s.topic_zipf
        self.topic_weights = weights / weights.sum()

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
