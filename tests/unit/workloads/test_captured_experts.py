"""CapturedMixes: expert mixes read from captured signatures (bench/capture_signatures.py's file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pd_plugins.vocab.expert_signature import ExpertSignature
from pd_plugins.workloads.experts import CapturedMixes

REPO_FILE = Path(__file__).resolve().parents[3] / "bench" / "data" / "captured_signatures.json"


def signature(hot: list[int], layers: int = 2, experts: int = 8) -> dict:
    counts = np.zeros((layers, experts))
    counts[:, hot] = 10
    counts[:, hot[0]] = 20  # one expert at the top level, the others at the middle levels
    return ExpertSignature.from_counts(counts).encode()


@pytest.fixture
def captured(tmp_path):
    path = tmp_path / "captured.json"
    path.write_text(json.dumps({"top_k": 2, "families": {
        "a": [{"tokens": 64, "signature": signature([0, 1])},
              {"tokens": 90, "signature": signature([0, 2])}],
        "b": [{"tokens": 70, "signature": signature([6, 7])}]}}))
    return path


def test_requests_draw_a_family_and_one_of_its_prompts(captured):
    mixes = CapturedMixes(captured, seed=1)
    assert (mixes.layers, mixes.experts, mixes.top_k) == (2, 8, 2)
    topics = [mixes.topic(r) for r in range(400)]
    assert set(topics) == {0, 1} and topics.count(0) > topics.count(1)  # Zipf: "a" is first
    assert [mixes.topic(r) for r in range(50)] == [CapturedMixes(captured, seed=1).topic(r)
                                                    for r in range(50)]
    in_a = {tuple(mixes.histogram(r, 100)[0]) for r in range(400) if mixes.topic(r) == 0}
    assert len(in_a) == 2  # both captured prompts of family a are used


def test_histogram_is_the_signature_and_routing_reads_it_back(captured):
    mixes = CapturedMixes(captured)
    r = next(r for r in range(100) if mixes.topic(r) == 1)
    sent = ExpertSignature.decode(signature([6, 7])).histogram()
    assert np.array_equal(mixes.histogram(r, 70), sent)
    routing = mixes.routing(r)
    assert np.allclose(routing.sum(axis=1), 1.0)
    # levels 3 and 2 read as 1 and 2/3 of the top expert; unused experts as a twelfth
    assert np.allclose(routing[0] / routing[0].max(), [1 / 12] * 6 + [1, 2 / 3])
    assert np.array_equal(mixes.pick(r), np.minimum(1.0, 2 * routing))


def test_mixed_shapes_are_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"top_k": 2, "families": {
        "a": [{"tokens": 1, "signature": signature([0], experts=8)}],
        "b": [{"tokens": 1, "signature": signature([0], experts=4)}]}}))
    with pytest.raises(ValueError, match="one shape"):
        CapturedMixes(path)


def test_the_committed_capture_has_family_structure():
    """The repository's captured file: prompts of one family are more alike than across."""
    mixes = CapturedMixes(REPO_FILE)
    fam = mixes.signatures
    cos = lambda x, y: float(np.mean(np.einsum("le,le->l", x, y)  # noqa: E731
                                     / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)))
    within = np.mean([cos(a.histogram(), b.histogram()) for f in fam for a, b in zip(f, f[1:])])
    across = np.mean([cos(a.histogram(), b.histogram()) for f, g in zip(fam, fam[1:])
                      for a, b in zip(f, g)])
    assert within > across + 0.1, (within, across)
