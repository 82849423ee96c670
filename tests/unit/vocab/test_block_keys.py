"""Block keys are the same in every process: router replicas compare the keys of text prompts
(no tokenizer) that each of them hashed, and hash() of a str is salted per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pd_plugins.vocab.block_keys import ROOT_KEY, adapter_root, block_keys, text_block_keys

TEXTS = ["You are a helpful assistant. " * 20, "Grüße aus Köln, 東京 and ☃ " * 12]
KEYS_SCRIPT = """
import json, sys
from pd_plugins.vocab.block_keys import adapter_root, block_keys, text_block_keys
texts = json.loads(sys.argv[1])
print(json.dumps([[text_block_keys(t, 16, 4, adapter_root(a)) for t in texts] for a in (None, "lora-a")]
                 + [block_keys(list(range(64)), 16)]))
"""


def keys_here() -> list:
    return ([[text_block_keys(t, 16, 4, adapter_root(a)) for t in TEXTS] for a in (None, "lora-a")]
            + [block_keys(list(range(64)), 16)])


@pytest.mark.processes
def test_two_processes_with_different_hash_seeds_compute_the_same_keys():
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", KEYS_SCRIPT, json.dumps(TEXTS)], env=env,
                             capture_output=True, text=True, timeout=60, check=True)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1] == keys_here()
    assert all(outputs[0][0]) and outputs[0][0] != outputs[0][1]  # keys exist; the adapter's differ


def test_text_keys_are_pinned_chained_and_cover_full_blocks_only():
    text = "abcd" * 40  # 160 characters: two full blocks of 16 tokens x 4 characters, 32 left over
    keys = text_block_keys(text, 16)
    # a fixed answer: replicas of different builds agree as long as this holds
    assert keys == [6549517172742143124, 444156452545520608]
    assert text_block_keys(text[:64], 16) == keys[:1]  # a prefix's keys are a prefix of the keys
    assert text_block_keys("x" + text[1:], 16)[1] != keys[1]  # a later key depends on the first block
    assert text_block_keys(text[:63], 16) == []
    assert text_block_keys(text, 16, parent=adapter_root("a")) != keys
    assert text_block_keys(text, 16, parent=ROOT_KEY) == keys


def test_non_ascii_text_is_cut_by_characters():
    text = "ä" * 64 + "b" * 64
    keys = text_block_keys(text, 16)
    assert len(keys) == 2 and keys[0] == text_block_keys("ä" * 64, 16)[0]
    assert keys[0] != text_block_keys("a" * 64, 16)[0]
    assert text_block_keys("\ud800" * 64, 16)  # a lone surrogate (from JSON) still hashes
