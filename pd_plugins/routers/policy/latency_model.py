"""Latency models the router learns from what it measures (Mooncake-style TTFT estimates).

prefill_s(uncached) = a + b * uncached   fitted online from every prefill leg the router runs;
decode_step_s(batch) = a + b * batch      fitted online from streamed TPOT and the decode's load.
Both forget old samples exponentially, so they follow a machine whose speed drifts. Until enough
samples arrive they use the configured priors. a and b stay >= 0 (a negative intercept refits the
line through the origin), and samples of (nearly) one size keep the prior's slope. Router replicas
feed each other's samples in (routers/replica_channels.py, LatencyChannel): each measures only the
legs it runs, and alone it would stay on the priors twice as long.
"""

from __future__ import annotations

from typing import Callable

from pd_plugins.routers.config import LatencySpec


# Below this spread of the samples' x (standard deviation over mean) the slope is the prior's.
MIN_RELATIVE_SPREAD = 0.1


class OnlineLinearFit:
    """Exponentially weighted least squares for y = a + b x, with a >= 0 and b >= 0."""

    def __init__(self, prior_a: float, prior_b: float, decay: float = 0.98, min_samples: int = 8):
        self.prior = (prior_a, prior_b)
        self.decay, self.min_samples = decay, min_samples
        self.n = 0
        # the weighted sums of 1, x, y, x*x and x*y: one tuple, so that a sample (on every leg)
        # reads and writes one attribute, not five
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)
        self.on_sample: Callable[[float, float], None] | None = None  # told of each own sample

    def observe(self, x: float, y: float) -> None:
        """A sample this router measured."""
        self.learn(x, y)
        if self.on_sample is not None:
            self.on_sample(x, y)

    def learn(self, x: float, y: float) -> None:
        """Fold a sample in (this router's, or another replica's)."""
        d = self.decay
        w, sx, sy, sxx, sxy = self._sums
        self._sums = (w * d + 1.0, sx * d + x, sy * d + y, sxx * d + x * x, sxy * d + x * y)
        self.n += 1

    @property
    def fitted(self) -> bool:
        """Whether the line comes from samples (below `min_samples` it is the prior)."""
        return self.n >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, float]:
        """(a, b) with a, b >= 0: the line through the samples' (weighted) mean, or, where that
        needs a < 0, the least-squares line through the origin (b = sum xy / sum xx, same
        weights). Clamping a to 0 and keeping the slope fitted with the negative a lifted the
        line off the samples (up to 10x at their own size)."""
        if not self.fitted:
            return self.prior
        w, sx, sy, sxx, sxy = self._sums
        mean_x, mean_y = sx / w, sy / w
        var_x = sxx / w - mean_x * mean_x
        if var_x < (MIN_RELATIVE_SPREAD * mean_x) ** 2 or var_x <= 1e-12:
            # The samples sit at (nearly) one x: their jitter, not the machine, would set the
            # slope (a 1-token spread and 10 ms of jitter gave 250x the real one). Keep the prior.
            slope = self.prior[1]
        else:
            slope = max(0.0, (sxy / w - mean_x * mean_y) / var_x)
        intercept = mean_y - slope * mean_x
        if intercept >= 0.0:
            return intercept, slope
        if sxx <= 0.0:  # every sample at x = 0
            return max(0.0, mean_y), 0.0
        return 0.0, max(0.0, sxy / sxx)  # least squares through the origin

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
