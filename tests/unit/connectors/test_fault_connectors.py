"""The test-only FaultyNixlConnector (pd_plugins/testing/fault_connectors.py): registered only
where KV faults are allowed, refused without the allow variable or under production, and its
`corrupt` / `reuse` hooks on real KV tensors."""

from __future__ import annotations

import gc
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnectorWorker,
    NixlPushConnectorWorker,
)

from pd_plugins import vllm_plugin
from pd_plugins.connectors import registry
from pd_plugins.connectors.vllm.block_verifier import BlockVerifier
from pd_plugins.testing import fault_connectors
from pd_plugins.transfer.kv_faults import ALLOWED_VAR, PRODUCTION_VAR, KvFaults
from pd_plugins.transfer.options import OptionError

NAME = "FaultyNixlConnector"


def test_listed_only_where_faults_are_allowed():
    assert registry.allowed_test_connectors({}) == ()
    assert registry.allowed_test_connectors({ALLOWED_VAR: "0"}) == ()
    assert [s.name for s in registry.allowed_test_connectors({ALLOWED_VAR: "1"})] == [NAME]
    assert registry.allowed_test_connectors({ALLOWED_VAR: "1", PRODUCTION_VAR: "1"}) == ()
    assert NAME not in {spec.name for spec in registry.VLLM_CONNECTORS}


@pytest.mark.parametrize("env, registered", [
    ({}, False), ({ALLOWED_VAR: "1"}, True), ({ALLOWED_VAR: "1", PRODUCTION_VAR: "1"}, False)])
def test_the_plugin_registers_it_only_where_faults_are_allowed(monkeypatch, env, registered):
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    monkeypatch.delitem(KVConnectorFactory._registry, NAME, raising=False)
    for var in (ALLOWED_VAR, PRODUCTION_VAR):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert (NAME in vllm_plugin.register()) == registered
    assert (NAME in KVConnectorFactory._registry) == registered
    if registered:
        cls = KVConnectorFactory.get_connector_class_by_name(NAME)
        assert cls is fault_connectors.FaultyNixlConnector


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("faults", ["corrupt:match=kvfault-", None])  # none set: refused all the same
@pytest.mark.parametrize("env, why", [
    ({}, f"needs {ALLOWED_VAR}=1"),
    ({ALLOWED_VAR: "1", PRODUCTION_VAR: "1"}, "never allowed in production")])
def test_the_connector_refuses_to_start_unless_allowed(monkeypatch, mode, faults, env, why):
    for var in (ALLOWED_VAR, PRODUCTION_VAR):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    extra = {"mode": mode, "faults": faults}
    kv = SimpleNamespace(get_from_extra_config=lambda key, default: extra.get(key, default))
    config = SimpleNamespace(kv_transfer_config=kv)
    with pytest.raises(OptionError, match=why):  # before upstream's connector is built
        fault_connectors.FaultyNixlConnector(config, KVConnectorRole.WORKER, None)


def test_the_upstream_privates_it_uses_exist():
    assert {"read_spec", "dst_engine_id", "request_id", "remote_request_id"} <= set(
        inspect.signature(NixlPushConnectorWorker._xfer_blocks).parameters)
    # Python 3.11's ast.parse fails ("AST constructor recursion depth mismatch") when a garbage
    # collection inside it formats a traceback (a dead task's "exception never retrieved"):
    # collect what earlier tests left first (the stop-41 CI run failed so after a hung test)
    gc.collect()
    source = inspect.getsource(NixlBaseConnectorWorker)
    assert "self.world_size =" in source


def kv(seed: int, blocks: int = 10) -> BlockVerifier:
    gen = torch.Generator().manual_seed(seed)
    return BlockVerifier([torch.randn(blocks, 2, 4, 8, generator=gen) for _ in range(3)], blocks)


def allowed_faults(spec: str) -> KvFaults:
    return KvFaults.from_spec(spec, "t", environ={ALLOWED_VAR: "1"})


def test_corrupt_damages_one_landed_block_of_a_targeted_read_only():
    blocks = kv(1)
    faults = allowed_faults("corrupt:match=kvfault-")
    before = blocks.digests(range(10))
    assert fault_connectors.damage_landed(faults, blocks, "clean-1", [2, 3]) is None
    assert (blocks.digests(range(10)) == before).all()
    assert fault_connectors.damage_landed(faults, blocks, "kvfault-1", [4, 5, 6]) == "corrupt"
    changed = np.flatnonzero(blocks.digests(range(10)) != before).tolist()
    assert len(changed) == 1 and changed[0] in (4, 5, 6)
    assert faults.injected["corrupt"] == 1


def test_reuse_overwrites_a_landed_block_with_another_blocks_bytes():
    blocks = kv(2)
    faults = allowed_faults("reuse:match=kvfault-")
    before = blocks.digests(range(10))
    assert fault_connectors.damage_landed(faults, blocks, "kvfault-2", [4, 5]) == "reuse"
    after = blocks.digests(range(10))
    changed = np.flatnonzero(after != before).tolist()
    assert len(changed) == 1 and changed[0] in (4, 5)
    assert after[changed[0]] in set(before.tolist()) - {before[changed[0]]}
    assert faults.injected == {**faults.injected, "reuse": 1, "corrupt": 0}
