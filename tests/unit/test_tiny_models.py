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
