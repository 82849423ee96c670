import json

import pytest

from pd_plugins.testing.tiny_models import (
    MODEL_RECIPES,
    ensure_tiny_model,
    greedy_diversity,
    recipe_hash,
)


@pytest.mark.parametrize("name", sorted(MODEL_RECIPES))
def test_tiny_model_is_cached_float32_and_diverse(name):
    path = ensure_tiny_model(name)
    assert path == ensure_tiny_model(name)  # cached, same folder
    assert path.name.endswith(recipe_hash(name))
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    # Greedy output of a default random init repeats one token; ours must not.
    assert greedy_diversity(path, "the quick prefill of a cache block") >= 16


def test_unknown_model_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown tiny model 'tiny-gpt'"):
        ensure_tiny_model("tiny-gpt")


def test_tiny_adapters_are_cached_peft_files_that_change_the_output():
    """Each adapter merged into the base weights (W + alpha/r * B @ A, what vLLM's LoRA layers
    compute) gives another greedy output than the base model and than the other adapter."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pd_plugins.testing.tiny_models import ADAPTER_RECIPES, adapter_hash, ensure_tiny_adapter

    base_dir = ensure_tiny_model("tiny-llama")
    prompt = torch.tensor([list(range(10, 60))])
    outputs = []
    for name in (None, *sorted(ADAPTER_RECIPES)):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if name is not None:
            path = ensure_tiny_adapter(name)
            assert path == ensure_tiny_adapter(name) and path.name.endswith(adapter_hash(name))
            config = json.loads((path / "adapter_config.json").read_text())
            assert config["peft_type"] == "LORA" and config["r"] == 8
            weights = load_file(str(path / "adapter_model.safetensors"))
            params = dict(model.named_parameters())
            with torch.no_grad():
                for key, a in weights.items():
                    if key.endswith("lora_A.weight"):
                        b = weights[key.replace("lora_A", "lora_B")]
                        assert b.abs().sum() > 0  # a zero B (a fresh PEFT init) changes nothing
                        target = key.removeprefix("base_model.model.").replace(".lora_A", "")
                        params[target] += config["lora_alpha"] / config["r"] * b @ a
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        outputs.append(tuple(out[0, prompt.shape[1]:].tolist()))
    assert len(set(outputs)) == len(outputs), outputs


def test_unknown_adapter_is_a_clear_error():
    from pd_plugins.testing.tiny_models import ensure_tiny_adapter

    with pytest.raises(KeyError, match="unknown tiny adapter 'lora-x'"):
        ensure_tiny_adapter("lora-x")
