"""Roofline latency of one model on one GPU: prefill, decode steps, KV size and KV transfer.

Every step is bounded by compute or by memory traffic, whichever is slower (the roofline):

    step_s = overhead_s + max(flops / (peak_flops * mfu), bytes / (hbm_bytes_per_s * mbu))

    flops  = 2 * active_params * tokens                       (the matmuls, every token in the step)
           + 4 * layers * heads * head_dim * attended          (QK^T and AV: 2 matmuls x 2 flops)
    bytes  = weight_bytes_read(decode batch) + kv_tokens_read * kv_bytes_per_token

`attended` sums, over the step's tokens, the context each token attends to: a prefill chunk of n
new tokens after c cached ones attends n*c + n*(n+1)/2 positions, a decode token its whole context.
`kv_bytes_per_token = 2 (K and V) * layers * kv_heads * head_dim * dtype_bytes`.

Weights are read once per step. For a MoE model only the experts the batch activates are read: with
E experts, top-k routing and b tokens, the expected share of distinct experts per layer is
1 - (1 - k/E)^b (uniform routing), so small decode batches read far fewer bytes than the full model.
When the decode requests' own routing is known (ELDR workloads, engine_model.py), their share is
1 - mean over layers and experts of prod_r (1 - p_r), p_r the chance request r's token picks the
expert: requests that use the same experts read fewer distinct experts together.

KV capacity = gpu_bytes * memory_utilisation - weight bytes, in tokens. A KV transfer takes
link_latency_s + tokens * kv_bytes_per_token / link_bytes_per_s.

A host tier (host_kv_bytes > 0; none by default) keeps copies of KV blocks in host memory (vLLM's
CPU offloading, LMCache's local CPU backend); loading tokens from it back to the GPU takes
tokens * kv_bytes_per_token / host_link_bytes_per_s (PCIe).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelSpec:
    name: str
    total_params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    experts: int = 0                # MoE: routed experts per layer (0: dense)
    top_k: int = 0
    expert_params: float = 0.0      # params in all routed experts together

    @property
    def dense_params(self) -> float:
        return self.total_params - self.expert_params

    @property
    def active_params(self) -> float:
        """Params each token multiplies through."""
        if not self.experts:
            return self.total_params
        return self.dense_params + self.expert_params * self.top_k / self.experts

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def expert_share(self, tokens: int) -> float:
        """Expected share of experts `tokens` uniformly routed tokens activate (per layer)."""
        return 1.0 - (1.0 - self.top_k / self.experts) ** max(0, tokens)

    def weight_bytes_read(self, tokens: int, known_share: float | None = None,
                          known_tokens: int = 0) -> float:
        """Weight bytes one step reads when it processes `tokens` tokens. `known_share`: the
        share of experts that `known_tokens` of them activate, when known (the decode batch's
        actual expert mix, engine_model.py); the other tokens are routed uniformly."""
        if not self.experts:
            return self.total_params * self.dtype_bytes
        if known_share is None:
            share = self.expert_share(max(1, tokens))
        else:
            share = 1.0 - (1.0 - known_share) * (1.0 - self.expert_share(tokens - known_tokens))
        return (self.dense_params + self.expert_params * share) * self.dtype_bytes


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float               # dense bf16
    hbm_bytes_per_s: float
    memory_bytes: float


class HostTier:
    """The host tier of a profile with `host_kv_bytes`, `host_link_bytes_per_s` and `kv_bytes()`
    (Hardware here, calibration.CalibratedHardware)."""

    def host_load_s(self, tokens: int) -> float:
        """Loading `tokens` of KV from the host tier into GPU memory."""
        if tokens <= 0:
            return 0.0
        return self.kv_bytes(tokens) / self.host_link_bytes_per_s

    def host_capacity_tokens(self) -> int:
        per_token = self.kv_bytes(1)
        return int(self.host_kv_bytes // per_token) if per_token else 0


@dataclass(frozen=True)
class Hardware(HostTier):
    """One engine instance: a model on a GPU, with achieved-efficiency factors and its KV link."""

    model: ModelSpec
    gpu: GpuSpec
    mfu: float = 0.5                # share of peak FLOP/s a large prefill achieves
    mbu: float = 0.8                # share of HBM bandwidth a decode step achieves
    overhead_s: float = 0.002       # scheduling and launch cost of every step
    memory_utilisation: float = 0.9  # vLLM --gpu-memory-utilization
    link_bytes_per_s: float = 50e9  # KV transfer link (400 Gb/s RDMA)
    link_latency_s: float = 0.001
    host_kv_bytes: float = 0.0      # host memory for KV copies per instance (0: no host tier)
    host_link_bytes_per_s: float = 25e9  # host to GPU (PCIe 5.0 x16, about half its peak)

    @property
    def name(self) -> str:
        return f"{self.model.name} on {self.gpu.name}"

    def _attention_flops(self, attended: float) -> float:
        m = self.model
        return 4.0 * m.layers * m.heads * m.head_dim * attended

    def step_s(self, prefill_chunks: list[tuple[int, int]] = (), decode_batch: int = 0,
               decode_kv_tokens: int = 0, decode_expert_share: float | None = None) -> float:
        """One engine step: prefill chunks (new tokens, tokens before them) plus a decode batch
        whose requests hold `decode_kv_tokens` tokens of context in total and, when known,
        activate `decode_expert_share` of each MoE layer's experts."""
        m = self.model
        new = sum(n for n, _ in prefill_chunks)
        attended = sum(n * c + n * (n + 1) / 2 for n, c in prefill_chunks) + decode_kv_tokens
        tokens = new + decode_batch
        if tokens == 0:
            return 0.0
        flops = 2.0 * m.active_params * tokens + self._attention_flops(attended)
        kv_read = decode_kv_tokens + sum(n + c for n, c in prefill_chunks)
        bytes_ = (m.weight_bytes_read(tokens, decode_expert_share, decode_batch)
                  + kv_read * m.kv_bytes_per_token)
        g = self.gpu
        return self.overhead_s + max(flops / (g.peak_flops * self.mfu),
                                     bytes_ / (g.hbm_bytes_per_s * self.mbu))

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """A whole prefill run alone in one step (no chunking)."""
        return self.step_s([(new_tokens, cached_tokens)])

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        return self.step_s(decode_batch=batch, decode_kv_tokens=kv_tokens)

    def kv_bytes(self, tokens: int) -> float:
        return tokens * self.model.kv_bytes_per_token

    def transfer_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.link_latency_s + self.kv_bytes(tokens) / self.link_bytes_per_s

    def kv_capacity_tokens(self) -> int:
        free = self.gpu.memory_bytes * self.memory_utilisation - self.model.weight_bytes_read(10**9)
        if free <= 0:
            raise ValueError(f"{self.name}: the weights do not fit in memory")
        return int(free // self.model.kv_bytes_per_token)

    def with_(self, **changes) -> Hardware:
        return replace(self, **changes)


MODELS = {
    # Llama-3.1-8B: 32 layers, 32 heads, 8 KV heads (GQA), head_dim 128.
    "llama-3.1-8b": ModelSpec("Llama-3.1-8B", 8.03e9, layers=32, heads=32, kv_heads=8, head_dim=128),
    # Qwen3-30B-A3B: 48 layers, 32 heads, 4 KV heads, 128 experts (top-8) of 3*2048*768 params each.
    "qwen3-30b-a3b": ModelSpec("Qwen3-30B-A3B", 30.5e9, layers=48, heads=32, kv_heads=4, head_dim=128,
                               experts=128, top_k=8, expert_params=48 * 128 * 3 * 2048 * 768),
}
GPUS = {
    "h100": GpuSpec("H100-SXM", peak_flops=989e12, hbm_bytes_per_s=3.35e12, memory_bytes=80e9),
    "h200": GpuSpec("H200", peak_flops=989e12, hbm_bytes_per_s=4.8e12, memory_bytes=141e9),
}


def preset(name: str) -> Hardware:
    """`MODEL@GPU`, e.g. `llama-3.1-8b@h100` or `qwen3-30b-a3b@h200`."""
    model, _, gpu = name.partition("@")
    if model not in MODELS or gpu not in GPUS:
        raise ValueError(f"unknown hardware preset {name!r}; models: {', '.join(MODELS)}; "
                         f"GPUs: {', '.join(GPUS)} (write MODEL@GPU)")
    return Hardware(MODELS[model], GPUS[gpu])


PRESETS = [f"{m}@{g}" for m in MODELS for g in GPUS]
