"""Expert capture's row bookkeeping: which rows of a step are whose prompt tokens.

The runner here is a named stand-in for vLLM's model runner (only the fields the capture reads:
the input batch's request order, computed and prompt lengths, and query_start_loc); the real one
is exercised end to end in tests/e2e/test_expert_signatures.py.
"""

from types import SimpleNamespace

import numpy as np
import torch

from pd_plugins.patches.moe_capture import ExpertCapture, version_supported
from pd_plugins.vocab.expert_signature import ExpertSignature


class FakeRunner:
    """Stand-in for vLLM's model runner: the fields ExpertCapture reads."""

    def __init__(self, req_ids, computed, prompts, scheduled) -> None:
        starts = np.concatenate([[0], np.cumsum(scheduled)])
        self.input_batch = SimpleNamespace(req_ids=list(req_ids) + [None],
                                           num_reqs=len(req_ids),
                                           num_computed_tokens_cpu=np.array(computed),
                                           num_prompt_tokens=np.array(prompts))
        self.query_start_loc = SimpleNamespace(np=starts)


def test_prompt_rows_only_chunks_add_up_and_completion_is_reported():
    cap = ExpertCapture(layers=2, experts=4)
    # step 1: "a" prefills its first 3 of 5 prompt tokens, "d" decodes one token
    runner1 = FakeRunner(["a", "d"], computed=[0, 9], prompts=[5, 9], scheduled=[3, 1])
    cap.step_prepared(runner1)
    for layer in range(2):
        cap.capture(layer, torch.tensor([[0, 1], [0, 1], [0, 2], [3, 3]]))
    assert cap.take_signatures() == {}  # "a" not complete; "d" is decoding
    # step 2: the last 2 prompt tokens of "a": its prompt is complete
    runner2 = FakeRunner(["a"], computed=[3], prompts=[5], scheduled=[2])
    cap.step_prepared(runner2)
    for layer in range(2):
        cap.capture(layer, torch.tensor([[0, 3], [1, 3]]))
    sigs = cap.take_signatures()
    assert list(sigs) == ["a"]
    counts = np.array([[4, 3, 1, 2]] * 2)  # 5 prompt tokens x top-2 = 10 choices per layer
    assert np.array_equal(ExpertSignature.decode(sigs["a"]).levels,
                          ExpertSignature.from_counts(counts).levels)
    assert cap.take_signatures() == {}


def test_no_step_no_capture_and_version_check_runs():
    cap = ExpertCapture(layers=1, experts=2)
    cap.capture(0, torch.tensor([[0, 1]]))  # before any step was prepared: ignored
    assert cap.take_signatures() == {}
    assert isinstance(version_supported(), bool)


def test_capture_times_itself_per_prompt(monkeypatch):
    """capture_us: each hook call's time split evenly over the step's prompts, plus the signature
    build. A clock that advances 1 us per reading makes every timed section cost exactly 1 us."""
    ticks = iter(range(0, 10**9, 1000))
    monkeypatch.setattr("pd_plugins.patches.moe_capture.time.perf_counter_ns", lambda: next(ticks))
    cap = ExpertCapture(layers=2, experts=4)
    # "a" and "b" complete their prompts in one step; "d" decodes (no share of the cost)
    runner = FakeRunner(["a", "b", "d"], computed=[0, 0, 9], prompts=[2, 2, 9], scheduled=[2, 2, 1])
    cap.step_prepared(runner)  # held weakly, as vLLM's runner is
    for layer in range(2):
        cap.capture(layer, torch.tensor([[0, 1]] * 5))
    sigs = cap.take_signatures()
    assert sorted(sigs) == ["a", "b"]
    # hook 2 x 1 us + counting 1 us, split over 2 prompts, + 1 us for each signature: 2.5 us
    assert sigs["a"]["capture_us"] == sigs["b"]["capture_us"] == 2
    assert ExpertSignature.decode(sigs["a"]).layers == 2  # the extra field does not disturb decoding


def test_expert_signatures_asked_for_where_the_capture_cannot_run_refuse_to_start(monkeypatch):
    # the capture hooks V1's GPUModelRunner._prepare_inputs: under the V2 runner (vLLM's default
    # where Triton is), or on an unchecked vLLM, it never ran, and every finished prefill waited
    # for a signature in the scheduler with nothing in the log saying why
    import pytest

    from pd_plugins.connectors.vllm import expert_signatures as es
    from pd_plugins.patches import moe_capture

    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    def config(v2: bool):
        transfer = SimpleNamespace(kv_role="kv_producer", engine_id="e",
                                   get_from_extra_config=lambda key, default: True)
        return SimpleNamespace(kv_transfer_config=transfer, use_v2_model_runner=v2,
                               model_config=SimpleNamespace(get_num_experts=lambda: 8, model="m"))

    monkeypatch.setattr(es, "extra_flag", lambda cfg, option: True)
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        es.ExpertSignatures(config(v2=True), KVConnectorRole.SCHEDULER)
    monkeypatch.setattr(moe_capture, "version_supported", lambda: False)
    with pytest.raises(RuntimeError, match="expert_signatures to false"):
        es.ExpertSignatures(config(v2=False), KVConnectorRole.SCHEDULER)
