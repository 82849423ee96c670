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
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build_model(name, staging)
        try:
            staging.rename(target)  # atomic: a concurrent builder's copy wins, ours is dropped
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


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


if __name__ == "__main__":
    for model_name in MODEL_RECIPES:
        print(model_name, ensure_tiny_model(model_name))
