"""Engine timings fitted by a running router, for the simulator in place of a hardware preset.

pd-router fits two lines online from the legs it runs (routers/policy/latency_model.py):
prefill_s(tokens) = a + b * tokens from every prefill leg (over the uncached tokens of the leg and
those queued ahead of it), and decode_step_s(batch) = a + b * batch from streamed TPOTs at the
decode worker's load. `GET /admin/calibration` exports them per model:

    {"models": {"llama": {"prefill_base_s": ..., "prefill_per_token_s": ...,
                          "decode_step_base_s": ..., "decode_step_per_request_s": ...,
                          "kv_bytes_per_token": ..., "link_bytes_per_s": ...,
                          "decode_first_base_s": ..., "decode_first_per_token_s": ...,
                          "block_size": 16, "samples": {"prefill": 812, "decode_step": 790,
                                                        "decode_first": 640, "min_samples": 8}}}}

    cal = load_calibration("calibration.json", model="llama")   # or the dict, or fetch_calibration
    result = simulate(requests, SimConfig(hardware=cal.hardware(), block_tokens=cal.block_size))

`CalibratedHardware` answers what the engine model asks of a `Hardware` (perf/hardware.py), with
the fitted lines in place of the roofline: a step costs the slower of its prefill part
(a + b * new tokens) and its decode part (a + b * batch), as the roofline's max of compute and
memory time does. A decode leg of the pull flow waits before its first step for what the router
measured of it (`decode_first_*`: sending the leg, pulling the KV, less the first step); without
that line, the transfer is the router's configured kv_bytes_per_token / link_bytes_per_s.
Its KV capacity is not something the router sees: give it (vLLM logs "GPU KV cache size: N tokens"), else DEFAULT_KV_CAPACITY_TOKENS.

Times are the router's wall seconds; against pd-mock-engine at --speedup k they are k times
shorter than the mocks' model seconds.
"""

from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Mapping

from pd_plugins.perf.hardware import HostTier
from pd_plugins.routers.config import LatencySpec

DEFAULT_KV_CAPACITY_TOKENS = 1 << 20
_FIELDS = ("prefill_base_s", "prefill_per_token_s", "decode_step_base_s",
           "decode_step_per_request_s", "kv_bytes_per_token", "link_bytes_per_s")


@dataclass(frozen=True)
class CalibratedModel:
    """The little of a model the engine model reads (perf/hardware.py ModelSpec's names)."""

    name: str
    kv_bytes_per_token: float
    experts: int = 0                 # MoE expert reads are not modelled from a calibration
    top_k: int = 0


@dataclass(frozen=True)
class Calibration:
    name: str                        # the model's name at the router ("" for its unnamed one)
    prefill_base_s: float
    prefill_per_token_s: float
    decode_step_base_s: float
    decode_step_per_request_s: float
    kv_bytes_per_token: float = 0.0
    link_bytes_per_s: float = 25e9
    block_size: int = 16             # the router's prefix block size for this model
    # pull flow: decode leg to first token = base + per_token * prompt tokens the decode pulled
    # (None: not fitted; the transfer is then kv_bytes_per_token / link_bytes_per_s alone)
    decode_first_base_s: float | None = None
    decode_first_per_token_s: float | None = None
    samples: Mapping[str, int] = field(default_factory=dict)

    def hardware(self, kv_capacity_tokens: int | None = None) -> CalibratedHardware:
        return CalibratedHardware(self, DEFAULT_KV_CAPACITY_TOKENS if kv_capacity_tokens is None
                                  else kv_capacity_tokens)

    def latency_spec(self) -> LatencySpec:
        """The router's latency priors as this calibration found them."""
        return LatencySpec(prefill_base_s=self.prefill_base_s,
                           prefill_per_token_s=self.prefill_per_token_s,
                           decode_step_base_s=self.decode_step_base_s,
                           decode_step_per_request_s=self.decode_step_per_request_s,
                           kv_bytes_per_token=self.kv_bytes_per_token,
                           link_bytes_per_s=self.link_bytes_per_s)


@dataclass(frozen=True)
class CalibratedHardware(HostTier):
    """A `Hardware` stand-in whose step times are the calibration's fitted lines."""

    calibration: Calibration
    capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS
    link_latency_s: float = 0.0
    host_kv_bytes: float = 0.0      # as Hardware's: no host tier unless given
    host_link_bytes_per_s: float = 25e9

    @property
    def model(self) -> CalibratedModel:
        return CalibratedModel(self.calibration.name or "model", self.calibration.kv_bytes_per_token)

    @property
    def name(self) -> str:
        return f"{self.calibration.name or 'model'} (calibrated by the router)"

    @property
    def link_bytes_per_s(self) -> float:
        return self.calibration.link_bytes_per_s

    def step_s(self, prefill_chunks: list[tuple[int, int]] = (), decode_batch: int = 0,
               decode_kv_tokens: int = 0, decode_expert_share: float | None = None) -> float:
        c = self.calibration
        new = sum(n for n, _ in prefill_chunks)
        prefill = c.prefill_base_s + c.prefill_per_token_s * new if new else 0.0
        decode = (c.decode_step_base_s + c.decode_step_per_request_s * decode_batch
                  if decode_batch else 0.0)
        return max(prefill, decode)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.step_s([(new_tokens, cached_tokens)])

    def decode_step_s(self, batch: int, kv_tokens: int = 0) -> float:
        return self.step_s(decode_batch=batch, decode_kv_tokens=kv_tokens)

    def kv_bytes(self, tokens: int) -> float:
        return tokens * self.calibration.kv_bytes_per_token

    def transfer_s(self, tokens: int) -> float:
        """A decode leg's wait before its first step. Fitted: what the router measured from
        sending the leg to its first token, less that first step (the engine model adds it)."""
        c = self.calibration
        if c.decode_first_base_s is not None:
            leg = max(0.0, c.decode_first_base_s - self.decode_step_s(1))
            return leg + c.decode_first_per_token_s * max(0, tokens)
        if tokens <= 0 or not c.kv_bytes_per_token:
            return 0.0
        return self.link_latency_s + self.kv_bytes(tokens) / c.link_bytes_per_s

    def kv_capacity_tokens(self) -> int:
        return self.capacity_tokens

    def latency_priors(self) -> LatencySpec:
        """What the simulated router starts from (cluster_sim.latency_priors): the fit itself."""
        return self.calibration.latency_spec()


def load_calibration(source: str | os.PathLike | Mapping[str, Any], model: str | None = None,
                     require_fitted: bool = True) -> Calibration:
    """A calibration from `GET /admin/calibration`'s answer (a file path or the parsed dict).
    `model`: which model's, required when it holds several. `require_fitted`: refuse a model
    whose lines are still the router's priors (fewer samples than it needs to fit)."""
    if isinstance(source, Mapping):
        return _calibration(source, model, require_fitted)
    try:  # a file's errors name it (invalid JSON, UTF-8 or shape: all ValueErrors)
        with open(source, encoding="utf-8") as f:
            return _calibration(json.load(f), model, require_fitted)
    except ValueError as e:
        raise ValueError(f"{os.fspath(source)}: {e}") from None


def _calibration(data: Any, model: str | None, require_fitted: bool) -> Calibration:
    models = data.get("models") if isinstance(data, Mapping) else None
    if not isinstance(models, Mapping) or not models:
        raise ValueError("not a calibration: expected {\"models\": {name: {...}}} "
                         "(GET /admin/calibration's answer)")
    if model is None:
        if len(models) != 1:
            raise ValueError(f"the calibration holds several models ({', '.join(sorted(models))}): "
                             "name one")
        model = next(iter(models))
    if model not in models:
        raise ValueError(f"no model {model!r} in the calibration (it has "
                         f"{', '.join(repr(m) for m in sorted(models))})")
    entry = models[model]
    if not isinstance(entry, Mapping):
        raise ValueError(f"model {model!r}: expected an object of fitted lines, got {entry!r}")
    values = {key: _number(entry, key, model) for key in _FIELDS}
    if values["link_bytes_per_s"] <= 0:
        raise ValueError(f"model {model!r}: link_bytes_per_s must be > 0")
    # a step of no time: the planner's throughput (tokens / step time) would divide by zero
    for base, slope in (("prefill_base_s", "prefill_per_token_s"),
                        ("decode_step_base_s", "decode_step_per_request_s")):
        if not values[base] and not values[slope]:
            raise ValueError(f"model {model!r}: {base} and {slope} are both 0 (a step that takes "
                             "no time): not a fitted line")
    samples = entry.get("samples") or {}
    if not isinstance(samples, Mapping) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in samples.values()):
        raise ValueError(f"model {model!r}: samples must map each line to a count >= 0, "
                         f"got {samples!r}")
    if require_fitted:
        need = samples.get("min_samples", 1)
        for line in ("prefill", "decode_step"):
            if samples.get(line, 0) < need:
                raise ValueError(f"model {model!r}: the {line} line was fitted from "
                                 f"{samples.get(line, 0)} samples (the router needs {need}): "
                                 "these are its configured priors; let it serve traffic first "
                                 "(or pass require_fitted=False)")
    first: dict[str, float | None] = {"decode_first_base_s": None, "decode_first_per_token_s": None}
    if samples.get("decode_first", 0) >= samples.get("min_samples", 1):
        first = {key: _number(entry, key, model) for key in first}
    block_size = entry.get("block_size", 16)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"model {model!r}: block_size must be a positive int, got {block_size!r}")
    return Calibration(name=model, block_size=block_size, samples=dict(samples), **values, **first)


def _number(entry: Mapping[str, Any], key: str, model: str) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"model {model!r}: {key} must be a non-negative number, got {value!r}")
    return float(value)


def fetch_calibration(router_url: str, admin_token: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """`GET /admin/calibration` of a running router (load_calibration reads the answer)."""
    request = urllib.request.Request(router_url.rstrip("/") + "/admin/calibration",
                                     headers={"Authorization": f"Bearer {admin_token}"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310 - operator's URL
        return json.loads(resp.read(1 << 20))
