"""Expert signatures (ELDR): reduction, wire size, similarity, footprints and the locality band."""

import json

import numpy as np
import pytest

from pd_plugins.routers.policy.expert_signature import ExpertFootprint, locality_band, similarity
from pd_plugins.vocab.expert_signature import ExpertSignature


def topk(rng, layers, experts, tokens, k, hot):
    """Tokens that mostly pick from `hot` experts."""
    out = []
    for _ in range(layers):
        picks = np.where(rng.random((tokens, k)) < 0.9, rng.choice(hot, (tokens, k)),
                         rng.integers(0, experts, (tokens, k)))
        out.append(picks)
    return out


def test_reduction_levels():
    sig = ExpertSignature.from_counts(np.array([[0, 1, 5, 10], [3, 3, 0, 0]]))
    assert sig.levels.tolist() == [[0, 0, 2, 3], [3, 3, 0, 0]]  # a stray choice reads as unused
    with pytest.raises(ValueError):
        ExpertSignature.from_counts(np.array([1, 2, 3]))


def test_wire_form_round_trips_and_fits_2kb_for_48_layers_of_128_experts():
    rng = np.random.default_rng(0)
    sig = ExpertSignature.from_topk(topk(rng, 48, 128, 200, 8, np.arange(20)), 128)
    wire = sig.encode()
    assert len(json.dumps(wire)) <= 2048 + 64 and len(wire["levels"]) <= 2048
    back = ExpertSignature.decode(json.loads(json.dumps(wire)))
    assert np.array_equal(back.levels, sig.levels)


@pytest.mark.parametrize("bad", [None, [], {"layers": 2}, {"layers": 2, "experts": 4, "levels": "!!"},
                                 {"layers": 2, "experts": 4, "levels": "AAAA"},
                                 {"layers": 10**6, "experts": 4, "levels": ""}])
def test_malformed_signatures_are_refused(bad):
    with pytest.raises(ValueError):
        ExpertSignature.decode(bad)


def test_similarity_tells_prompt_families_apart():
    rng = np.random.default_rng(1)
    code = [ExpertSignature.from_topk(topk(rng, 8, 64, 100, 2, np.arange(0, 8)), 64).histogram()
            for _ in range(2)]
    prose = ExpertSignature.from_topk(topk(rng, 8, 64, 100, 2, np.arange(32, 40)), 64).histogram()
    assert similarity(code[0], code[0]) == pytest.approx(1.0)
    assert similarity(code[0], code[1]) > similarity(code[0], prose) + 0.3
    assert similarity(code[0], np.zeros_like(code[0])) == 0.0
    assert similarity(code[0], np.ones((2, 2))) == 0.0  # another model's shape


def test_footprint_adds_and_removes():
    fp = ExpertFootprint()
    a, b = np.eye(2)[None, 0].repeat(3, 0), np.eye(2)[None, 1].repeat(3, 0)
    fp.add(a)
    fp.add(b)
    assert np.allclose(fp.total, a + b) and fp.count == 2
    fp.remove(a)
    assert np.allclose(fp.total, b)
    fp.remove(b)
    assert fp.total is None and fp.count == 0


def test_locality_band():
    assert locality_band([0.9, 0.85, 0.5, 0.81], 0.1) == [0, 1, 3]
    assert locality_band([0.9, 0.85], 0.0) == [0]  # strict affinity
    assert locality_band([], 0.1) == []


def test_eldr_policy_rebinds_the_decode_to_the_matching_worker():
    from pd_plugins.routers.config import ConfigError
    from pd_plugins.routers.policy.base import build
    from pd_plugins.routers.policy.scheduler import Scheduler, preset
    from tests.unit.routers.helpers import context, request

    ctx = context(prefills=1, decodes=3)
    decodes = ctx.pool.by_role("decode")
    code, prose = np.zeros((2, 8)), np.zeros((2, 8))
    code[:, :2], prose[:, 6:] = 1.0, 1.0
    decodes[0].experts.add(prose)
    decodes[1].experts.add(code)
    decodes[1].in_flight = 2           # busier (within the load band), the only one running code
    decodes[2].in_flight = 0           # idle: matches nothing
    scheduler = Scheduler(preset("eldr"), ctx)
    assert scheduler.uses_expert_signatures
    info = request(list(range(16)))
    first = scheduler.schedule(info)   # no signature yet: least loaded
    assert first.decode is decodes[2]
    info.expert_histogram = code
    again = scheduler.rebind_decode(info, first)
    assert again.decode is decodes[1] and again.prefill is first.prefill
    decodes[2].experts.add(code * 0.95 + prose * 0.05)  # now as good, and less loaded
    assert scheduler.rebind_decode(info, first).decode is decodes[2]
    decodes[1].in_flight = 9           # far busier: the load band drops it despite the match
    assert scheduler.rebind_decode(info, first).decode is not decodes[1]
    with pytest.raises(ConfigError, match="tau"):
        build("filter", "expert_band", {"tau": 2.0}, ctx)
