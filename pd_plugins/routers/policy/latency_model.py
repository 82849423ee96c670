"""Latency models the router learns from what it measures (Mooncake-style TTFT estimates).

prefill_s(uncached) = a + b * uncached   fitted online from every prefill leg the router runs;
decode_step_s(batch) = a + b * batch      fitted online from streamed TPOT and the decode's load.
Both forget old samples exponentially, so they follow a machine whose speed drifts. Until enough
samples arrive they use the configured priors. Router replicas feed each other's samples in
(routers/replica_channels.py, LatencyChannel): each measures only the legs it runs, and alone it
would stay on the priors twice as long.
"""

from __future__ import annotations

from typing import Callable

from pd_plugins.routers.config import LatencySpec


class OnlineLinearFit:
    """Exponentially weighted least squares for y = a + b x."""

    def __init__(self, prior_a: float, prior_b: float, decay: float = 0.98, min_samples: int = 8):
        self.prior = (prior_a, prior_b)
        self.decay, self.min_samples = decay, min_samples
        self.n = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.on_sample: Callable[[float, float], None] | None = None  # told of each own sample

    def observe(self, x: float, y: float) -> None:
        """A sample this router measured."""
        self.learn(x, y)
        if self.on_sample is not None:
            self.on_sample(x, y)

    def learn(self, x: float, y: float) -> None:
        """Fold a sample in (this router's, or another replica's)."""
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.n += 1

    @property
    def coefficients(self) -> tuple[float, float]:
        if self.n < self.min_samples:
            return self.prior
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):  # all samples at one x: keep the prior slope
            slope = self.prior[1]
        else:
            slope = max(0.0, (self._xy / self._w - mean_x * mean_y) / var_x)
        return max(0.0, mean_y - slope * mean_x), slope

    def predict(self, x: float) -> float:
        a, b = self.coefficients
        return a + b * x


class LatencyModels:
    def __init__(self, priors: LatencySpec | None = None) -> None:
        self.priors = priors or LatencySpec()
        p = self.priors
        self.prefill = OnlineLinearFit(p.prefill_base_s, p.prefill_per_token_s)
        self.decode_step = OnlineLinearFit(p.decode_step_base_s, p.decode_step_per_request_s)

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.prefill.predict(uncached_tokens)

    def transfer_s(self, tokens: int) -> float:
        p = self.priors
        return tokens * p.kv_bytes_per_token / p.link_bytes_per_s if p.kv_bytes_per_token else 0.0

    def queue_s(self, queued_prefill_tokens: int, queued_requests: int) -> float:
        """Time until a new prefill starts: the queued prefills ahead of it."""
        if queued_requests <= 0:
            return 0.0
        a, b = self.prefill.coefficients
        return a * queued_requests + b * queued_prefill_tokens

    def decode_step_s(self, batch: float) -> float:
        return self.decode_step.predict(batch)
