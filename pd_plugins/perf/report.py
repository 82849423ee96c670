"""The numbers routing studies report, defined once for the simulator and the HTTP replay.

- TTFT, TPOT (mean time per output token after the first, per request), ITL (gaps between streamed
  tokens; the replay only) and end-to-end latency: mean and percentiles over served requests.
- SLO attainment (DistServe): the share of *all* requests that were served and met both the TTFT
  and the TPOT SLO; a rejected or failed request misses. Single-token answers have no TPOT.
- Goodput (DistServe): the highest request rate whose attainment is at least 90%, found over a
  sweep of rates and interpolated linearly where attainment crosses 90%.
- Prefix-cache hit rate: prompt tokens found cached over all prompt tokens that had to be
  prefilled; KV moved: bytes pulled from prefill to decode instances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        return ttft_s is not None and ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_s:g} s, TPOT <= {self.tpot_s * 1e3:g} ms"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    return {"mean": sum(values) / len(values) if values else None,
            **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def summarize(outcomes: Iterable, slo: Slo, span_s: float, *, cached_tokens: int,
              computed_tokens: int, kv_bytes_moved: float,
              itl_s: Sequence[float] = ()) -> dict:
    """`outcomes` have status, ttft_s, tpot_s, e2e_s (perf.cluster_sim.RequestOutcome or alike)."""
    outcomes = list(outcomes)
    served = [o for o in outcomes if o.status == "ok"]
    met = sum(1 for o in served if slo.met(o.ttft_s, o.tpot_s))
    prefilled = cached_tokens + computed_tokens
    return {
        "requests": len(outcomes),
        "served": len(served),
        "rejected": sum(1 for o in outcomes if o.status == "rejected"),
        "failed": sum(1 for o in outcomes if o.status == "failed"),
        "local_prefill": sum(1 for o in served if not o.disaggregated),
        "slo_attainment": met / len(outcomes) if outcomes else None,
        "throughput_rps": len(served) / span_s if span_s > 0 else None,
        "ttft_s": distribution([o.ttft_s for o in served if o.ttft_s is not None]),
        "tpot_s": distribution([o.tpot_s for o in served if o.tpot_s is not None]),
        "itl_s": distribution(list(itl_s)),
        "e2e_s": distribution([o.e2e_s for o in served if o.e2e_s is not None]),
        "cache_hit_rate": cached_tokens / prefilled if prefilled else None,
        "kv_gb_moved": kv_bytes_moved / 1e9,
    }


def goodput(rates: Sequence[float], attainments: Sequence[float], target: float = 0.9) -> float:
    """DistServe goodput from a sweep: the highest rate with attainment >= target (0 if none)."""
    points = sorted(zip(rates, attainments))
    best = 0.0
    for i, (rate, att) in enumerate(points):
        if att >= target:
            best = rate
            continue
        if i > 0 and points[i - 1][1] >= target:  # crossing between the last good and this one
            r0, a0 = points[i - 1]
            best = r0 + (rate - r0) * (a0 - target) / (a0 - att)
        break
    return best


def cdf(values: Sequence[float], points: int = 200) -> tuple[list[float], list[float]]:
    """(x, share <= x) for plotting, thinned to about `points` points."""
    s = sorted(values)
    if not s:
        return [], []
    step = max(1, len(s) // points)
    xs = s[::step] + [s[-1]]
    return xs, [min(1.0, (i * step + 1) / len(s)) for i in range(len(xs) - 1)] + [1.0]
