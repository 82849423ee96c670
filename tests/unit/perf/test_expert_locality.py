"""ELDR in the performance models: decode steps read the experts their batch uses, and the
`eldr` policy groups requests that use the same experts."""

import numpy as np
import pytest

from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.engine_model import EngineInstance, EngineRequest
from pd_plugins.perf.hardware import preset
from pd_plugins.workloads import TraceRequest
from pd_plugins.workloads.experts import ExpertMixes, ExpertMixSpec

HW = preset("qwen3-30b-a3b@h200")
SPEC = ExpertMixSpec(topics=4, seed=3)


def decode_step_time(picks) -> float:
    """The step time once every request (prompt 64, 50 tokens to make) is decoding."""
    inst = EngineInstance(HW, block_size=16)
    for i, pick in enumerate(picks):
        inst.submit(EngineRequest(i, prompt_tokens=64, output_tokens=50, block_keys=[],
                                  expert_pick=pick), 0.0)
    now = 0.0
    while len(inst._decoding) < len(picks):
        now += inst.plan(now)
        inst.finish(now)
    return inst.plan(now)


def test_mixes_are_reproducible_and_topics_cluster():
    a, b = ExpertMixes(SPEC), ExpertMixes(SPEC)
    assert np.array_equal(a.pick(7), b.pick(7))
    assert np.allclose(a.routing(7).sum(axis=1), 1.0)
    same = [r for r in range(200) if a.topic(r) == a.topic(0)][:2]
    other = next(r for r in range(200) if a.topic(r) != a.topic(0))
    h = {r: a.histogram(r, 500) for r in (*same, other)}
    cos = lambda x, y: float(np.mean(np.einsum("le,le->l", x, y)  # noqa: E731
                                     / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)))
    assert cos(h[same[0]], h[same[1]]) > cos(h[same[0]], h[other]) + 0.2


def test_a_batch_of_one_topic_decodes_faster_than_a_mixed_batch():
    mixes = ExpertMixes(SPEC)
    by_topic: dict[int, list[int]] = {}
    for r in range(400):
        by_topic.setdefault(mixes.topic(r), []).append(r)
    one_topic = [mixes.pick(r) for r in by_topic[0][:8]]
    mixed = [mixes.pick(by_topic[t][i]) for t in range(4) for i in range(2)]
    same, spread = decode_step_time(one_topic), decode_step_time(mixed)
    assert same < spread
    # and both read fewer expert bytes than uniform routing of the same batch size
    assert spread < decode_step_time([None] * 8) + 1e-12


def trace(n: int, rate: float) -> list[TraceRequest]:
    rng = np.random.default_rng(0)
    t, out = 0.0, []
    for i in range(n):
        t += rng.exponential(1 / rate)
        out.append(TraceRequest(i, t, int(rng.integers(200, 2000)), int(rng.integers(100, 400)),
                                tuple(range(10_000 * i, 10_000 * i + 4))))
    return out


def run(policy: str, mixes: ExpertMixes | None) -> tuple[float, float]:
    """(median TPOT, mean number of topics per decode worker's requests)."""
    result = simulate(trace(300, 20.0), SimConfig(HW, prefill_instances=2, decode_instances=4,
                                                  policy=policy, expert_mixes=mixes))
    assert all(o.status == "ok" for o in result.outcomes)
    topics: dict[int, set[int]] = {}
    for o in result.outcomes:
        topics.setdefault(o.decode, set()).add(mixes.topic(o.request_id))
    return (float(np.median([o.tpot_s for o in result.outcomes if o.tpot_s])),
            float(np.mean([len(t) for t in topics.values()])))


def test_eldr_groups_topics_on_decode_workers_and_cuts_tpot():
    mixes = ExpertMixes(SPEC)
    eldr_tpot, eldr_topics = run("eldr", mixes)
    balanced_tpot, balanced_topics = run("least_loaded", mixes)
    assert eldr_topics < balanced_topics  # least loaded spreads every topic everywhere
    assert eldr_tpot < balanced_tpot


def test_without_mixes_the_eldr_policy_is_least_loaded():
    reqs = trace(100, 20.0)
    a = simulate(reqs, SimConfig(HW, prefill_instances=2, decode_instances=4, policy="eldr"))
    b = simulate(reqs, SimConfig(HW, prefill_instances=2, decode_instances=4,
                                 policy="least_loaded"))
    assert [o.decode for o in a.outcomes] == [o.decode for o in b.outcomes]
    assert [o.tpot_s for o in a.outcomes] == pytest.approx([o.tpot_s for o in b.outcomes])


def test_the_modelled_mock_times_decode_steps_by_the_experts_its_batch_uses():
    """pd-mock-engine --latency-model with a MoE preset: prompts route as the mock's fake capture
    says (token t -> expert t mod E), so requests on the same experts decode faster together."""
    from pd_plugins.mock.engine import build_parser
    from pd_plugins.mock.modelled import ModelDriver

    def step_time(prompts) -> float:
        args = build_parser().parse_args(["--port", "1", "--side-port", "2",
                                          "--latency-model", "qwen3-30b-a3b@h200"])
        driver = ModelDriver(args)
        for ids in prompts:
            flight = driver.submit(len(ids), ids, 50, "local", arrived=0.0)
            assert flight.req.expert_pick.shape == (HW.model.layers, HW.model.experts)
        inst, now = driver.inst, 0.0
        while len(inst._decoding) < len(prompts):
            now += inst.plan(now)
            inst.finish(now)
        return inst.plan(now)

    # 8 prompts of 64 tokens: each over 8 experts; the same 8 for all, or 8 apart each
    same = [[e for e in range(8)] * 8 for _ in range(8)]
    apart = [[8 * r + e for e in range(8)] * 8 for r in range(8)]
    assert step_time(same) < step_time(apart)
