"""Pool connectors (PdShm, PdLMCache) on an engine of several TP ranks: before the forward pass of a
step with loads, the ranks share their failed loads, so that no rank stores blocks computed from
another rank's failed load (each layer's all-reduce mixes every rank's heads into every rank's
later blocks). Real torch.distributed gloo groups between real processes, as vLLM's CPU groups
are."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from pd_plugins.connectors.vllm.pool_connector import PoolWorkerSide, SyncPoolConnector

# One rank of a TP 2 engine, its TP group a gloo group as vLLM's CPU group is.
RANK = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from pd_plugins.connectors.vllm.pool_connector import PoolWorkerSide

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    side = PoolWorkerSide()
    if rank == 1:
        side.fail_blocks("a", [7])   # this rank's slots of block 7 were gone
    if rank == 0:
        side.fail_blocks("b", [21])  # a checksum mismatch here
    side.share_failed_loads([dist.new_group([0, 1])])
    stores = {"a": side.own_blocks("a", [5, 6, 7, 8]), "b": side.own_blocks("b", [20, 21, 22]),
              "c": side.own_blocks("c", [30, 31])}
    side.end_step()
    stores["a, next step"] = side.own_blocks("a", [7, 8])
    print(json.dumps(stores))
    dist.destroy_process_group()
""")


@pytest.mark.processes
def test_every_rank_stops_its_stores_at_any_ranks_failed_load(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-2000:]
    stores = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    # block 7 failed on rank 1 only, block 21 on rank 0 only: both ranks store up to them
    assert stores == [{"a": 2, "b": 1, "c": 2, "a, next step": 2}] * 2


class _Recorder:
    """Stands in for a connector (no vLLM engine runs here): what start_load_kv does with the
    step's metadata, its worker side and its process groups."""

    def __init__(self, stores: bool, has_loads: bool, groups: list) -> None:
        self.stores = stores
        self.meta = SimpleNamespace(has_loads=has_loads)
        self._rank_groups = groups
        self.shared = []
        self._worker = SimpleNamespace(start_load_kv=lambda meta: None,
                                       share_failed_loads=self.shared.append)

    def _get_connector_metadata(self):
        return self.meta


@pytest.mark.parametrize("stores, has_loads, groups, shares", [
    (True, True, ["tp"], True),     # a producer's step with loads, several ranks
    (True, False, ["tp"], False),   # no loads: nothing to agree on (and no collective per step)
    (False, True, ["tp"], False),   # a consumer stores nothing
    (True, True, [], False),        # one rank
])
def test_ranks_share_failed_loads_only_in_a_producers_steps_with_loads(stores, has_loads,
                                                                        groups, shares):
    connector = _Recorder(stores, has_loads, groups)
    SyncPoolConnector.start_load_kv(connector, None)
    assert connector.shared == ([groups] if shares else [])


def test_one_rank_alone_keeps_its_own_failed_loads():
    side = PoolWorkerSide()
    side.fail_blocks("a", [7])
    side.share_failed_loads([])
    assert side.own_blocks("a", [5, 6, 7, 8]) == 2
