"""PdLMCacheConnector's scheduler between TP sizes (issue 29), in vLLM's real scheduler: a TP 2
engine's lookups ask every rank's worker and count what all of them hold; `head_groups` with an
LMCache server (mp://) is refused at startup. (The pools themselves:
tests/unit/transfer/test_lmcache_head_groups.py; on real servers: tests/e2e/test_tp_shapes.py.)"""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from pd_plugins.transfer.lookup_channel import LookupServer, lookup_address  # noqa: E402
from tests.unit.connectors.vllm_scheduler import make_scheduler  # noqa: E402


def test_a_tp2_scheduler_counts_what_every_rank_holds(tmp_path):
    engine_id = f"lmc-tp2-{uuid.uuid4().hex[:8]}"
    held = {0: 96, 1: 64}  # leading tokens each rank's worker holds of the prompt
    servers = [LookupServer(lookup_address(engine_id, rank), lambda tokens, n=n: min(n, len(tokens)))
               for rank, n in held.items()]
    scheduler = make_scheduler("PdLMCacheConnector", "kv_consumer",
                               {"backend": f"fs://{tmp_path}", "head_groups": 2},
                               engine_id=engine_id, tensor_parallel_size=2)
    connector = scheduler.connector
    try:
        assert connector.lookup(list(range(200)), "") == 64
        assert connector.lookup(list(range(80)), "") == 64
        servers[1].close()
        servers.pop()
        assert connector.lookup(list(range(200)), "") == 0  # rank 1 silent: a miss, not rank 0's
    finally:
        connector.shutdown()
        for server in servers:
            server.close()


def test_head_groups_with_an_lmcache_server_is_refused_at_startup():
    with pytest.raises(ValueError, match=r"head_groups works with .* not with an LMCache server"):
        make_scheduler("PdLMCacheConnector", "kv_consumer",
                       {"backend": "mp://127.0.0.1:1", "head_groups": 2})
