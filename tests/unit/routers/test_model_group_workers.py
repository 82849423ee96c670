"""A model group's workers coming and going (model_group.py, accounting.py): what a removed worker
or role leaves behind in the group's tables, and role moves the group must refuse. In-process
routers over URLs nothing listens on (no leg is sent; the KV-event subscriber just retries)."""

from __future__ import annotations

import asyncio

import pytest

from pd_plugins.routers import accounting
from pd_plugins.routers.config import config_from_mapping
from pd_plugins.routers.model_group import MoveRefused
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.server import Router

X, Y = "http://127.0.0.1:18100", "http://127.0.0.1:18200"
PREFIX_POLICY = {"prefill": {"scorers": [{"name": "prefix_cache"}]},
                 "decode": {"scorers": [{"name": "prefix_cache"}]}}


def test_removing_one_role_of_a_kv_both_engine_keeps_the_other_roles_state():
    """The same engine (URL) as prefill and decode: removing its decode keeps what its prefill
    uses (KV events, the prefix index entries); removing both forgets them."""
    worker = {"url": X, "kv_both": True, "kv_events": "tcp://127.0.0.1:15557"}
    config = config_from_mapping({"policy": PREFIX_POLICY, "prefill": [worker],
                                  "decode": [worker, {"url": Y}]})

    async def main():
        router = Router(config)
        group = router.groups[""]
        await group.start(router.metrics, router.pools, router._pool_views, None)
        try:
            group.prefix_index.record_routed(X, [1, 2, 3])
            assert router.remove_worker(X, "decode") is not None
            assert X in group._subscribers and not group._subscribers[X].done()
            assert group.prefix_index.held_blocks(X) == 3
            assert router.remove_worker(X, "prefill") is not None
            await asyncio.sleep(0)
            assert X not in group._subscribers and group.prefix_index.held_blocks(X) == 0
        finally:
            await group.stop()

    asyncio.run(main())


def test_a_leg_that_ends_on_a_removed_worker_does_not_put_it_back_in_the_index():
    config = config_from_mapping({"policy": PREFIX_POLICY, "prefill": [{"url": X}],
                                  "decode": [{"url": Y}]})
    router = Router(config)
    group = router.groups[""]
    prefill = group.pool.get(X, "prefill")
    info = RequestInfo(prompt_tokens=48, block_keys=[7, 8, 9])
    charge = accounting.prefill_started(group.ctx, prefill, info)  # a leg in flight ...
    router.remove_worker(X, "prefill")  # ... when the worker is removed
    accounting.prefill_ended(prefill, info, charge)
    accounting.prefill_succeeded(group.ctx, prefill, info, charge, 0.1, None, record_prefixes=True)
    assert group.ctx.prefix_index.held_blocks(X) == 0
    decode = group.pool.get(Y, "decode")
    router.remove_worker(Y, "decode")
    accounting.request_succeeded(group.ctx, decode, info, record_prefixes=True)
    assert group.ctx.prefix_index.held_blocks(Y) == 0


def test_a_role_move_into_a_pool_that_holds_the_engine_already_is_refused():
    worker = {"url": X, "kv_both": True}
    router = Router(config_from_mapping({"prefill": [worker], "decode": [worker, {"url": Y}]}))
    group = router.groups[""]
    for w in group.pool:
        w.healthy = True
    prefill = group.pool.get(X, "prefill")
    with pytest.raises(MoveRefused) as refused:
        asyncio.run(router.move_worker(X, "prefill", drain_timeout_s=0))
    assert refused.value.status == 409 and "already a prefill worker" in str(refused.value)
    assert group.pool.get(X, "prefill") is prefill and group.pool.get(X, "decode") is not None


# -- what a role move and a removal wait for -----------------------------------------------------

TOKEN = "unit-admin-token"


async def admin_client(router):
    """The router's admin routes over real HTTP (aiohttp's test server on loopback)."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    app = web.Application()
    app.add_routes(router.admin.routes())
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


def test_a_move_and_a_removal_count_only_this_replicas_requests():
    """Other router replicas' requests (LoadChannel adds them to in_flight) are not this replica's
    to wait for: those replicas do not know of the move and keep sending. A move with 3 peer
    requests and 1 of ours waits for ours only; a removal reports ours as finishing."""
    from pd_plugins.routers.replica_channels import LoadChannel

    worker = {"url": X, "kv_both": True}
    router = Router(config_from_mapping({"decode": [worker, {"url": Y}], "admin_token": TOKEN}))
    group = router.groups[""]
    for w in group.pool:
        w.healthy = True
    loads = LoadChannel(lambda: router.workers)
    loads.apply("peer", [["decode", X, 3, 0, 300], ["decode", Y, 2, 0, 200]], now=0.0)
    x, y = group.pool.get(X, "decode"), group.pool.get(Y, "decode")
    assert (x.in_flight, y.in_flight) == (3, 2)
    info = RequestInfo(prompt_tokens=48, block_keys=[])

    async def main():
        mine = accounting.decode_started(x, info)
        loop = asyncio.get_running_loop()
        started = loop.time()
        move = asyncio.create_task(router.move_worker(X, "prefill", drain_timeout_s=5.0))
        await asyncio.sleep(0.3)
        assert not move.done()  # our request still runs there
        accounting.decode_ended(x, info, mine)
        result = await move
        assert loop.time() - started < 2.0  # not the whole drain timeout
        assert (result.drained, result.still_running) == (1, 0)
        assert group.pool.get(X, "prefill") is x

        accounting.decode_started(y, info)  # ours, still running when Y is removed
        client = await admin_client(router)
        try:
            resp = await client.delete("/admin/workers", json={"role": "decode", "worker": {"url": Y}},
                                       headers={"Authorization": f"Bearer {TOKEN}"})
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["finishing"] == 1
        finally:
            await client.close()

    asyncio.run(main())


def test_adding_a_worker_in_the_role_it_is_moving_into_is_refused():
    """While X drains toward prefill, an admin add of X as a prefill gets 409: the move would
    otherwise replace the added worker when the drain ends (the add answered success, and the
    worker it added was neither in the pool nor marked removed)."""
    worker = {"url": X, "kv_both": True}
    router = Router(config_from_mapping({"decode": [worker, {"url": Y}], "admin_token": TOKEN}))
    group = router.groups[""]
    for w in group.pool:
        w.healthy = True
    x = group.pool.get(X, "decode")
    info = RequestInfo(prompt_tokens=48, block_keys=[])

    async def main():
        leg = accounting.decode_started(x, info)  # the move drains it
        move = asyncio.create_task(router.move_worker(X, "prefill", drain_timeout_s=5.0))
        await asyncio.sleep(0.1)
        client = await admin_client(router)
        try:
            resp = await client.post("/admin/workers", json={"role": "prefill", "worker": worker},
                                     headers={"Authorization": f"Bearer {TOKEN}"})
            assert resp.status == 409, await resp.text()
            assert "moving to prefill" in (await resp.json())["error"]["message"]
        finally:
            await client.close()
        accounting.decode_ended(x, info, leg)
        await move
        assert group.pool.get(X, "prefill") is x and group.pool.get(X, "decode") is None
        assert group.pool.by_role("prefill") == [x]

    asyncio.run(main())


def test_a_kv_event_subscriber_that_ends_is_started_again(monkeypatch, caplog):
    """The router binds X's KV-event socket (`bind:`) on a port something else holds: the
    subscriber ends (address in use), is logged, and subscribes once the port is free. Before,
    it ended for good and X's events were never read."""
    import socket

    from pd_plugins.routers import model_group
    from pd_plugins.testing.processes import free_port

    monkeypatch.setattr(model_group, "SUBSCRIBE_RETRY_S", (0.1, 0.2))
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    config = config_from_mapping({"decode": [
        {"url": X, "kv_events": f"bind:tcp://127.0.0.1:{port}"}, {"url": Y}]})

    async def main():
        router = Router(config)
        group = router.groups[""]
        await group.start(router.metrics, router.pools, router._pool_views, None)
        try:
            with caplog.at_level("WARNING", logger="pd_router"):
                await asyncio.sleep(0.5)
                assert not group._subscribers[X].done(), group._subscribers[X].exception()
                assert X not in group.prefix_index.exact_workers
                blocker.close()  # the port is free: the next try binds it
                for _ in range(200):
                    if X in group.prefix_index.exact_workers:
                        break
                    await asyncio.sleep(0.02)
                assert X in group.prefix_index.exact_workers
            assert "KV events of http://127.0.0.1:18100 stopped" in caplog.text
            router.remove_worker(X, "decode")  # removing the worker ends it
            await asyncio.sleep(0)
            assert X not in group._subscribers
        finally:
            blocker.close()
            await group.stop()

    asyncio.run(main())
