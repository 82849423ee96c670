"""Both LMCache clients implement the LMCacheClient protocol with the same signatures, so the
connector can hold either (PdLMCacheConnector picks one by backend)."""

from __future__ import annotations

import inspect

import pytest

from pd_plugins.transfer.lmcache_client import LMCacheClient

METHODS = ["attach_kv", "lookup", "store", "retrieve", "close"]


def clients():
    from pd_plugins.transfer.lmcache_mp import LMCacheMPClient
    from pd_plugins.transfer.lmcache_pool import LMCachePool

    return [LMCachePool, LMCacheMPClient]


def parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_declares_what_the_connector_calls():
    declared = {name for name in vars(LMCacheClient) if not name.startswith("_")}
    assert declared == set(METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_both_clients_implement_each_method_with_the_protocol_s_signature(method):
    for client in clients():
        assert parameters(getattr(client, method)) == parameters(getattr(LMCacheClient, method)), (
            client.__name__)


def test_a_client_instance_is_an_lmcache_client_and_other_objects_are_not():
    for client in clients():
        assert isinstance(object.__new__(client), LMCacheClient)
    assert not isinstance(object(), LMCacheClient)
