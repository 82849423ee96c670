"""Several models behind one router: the `models:` config, the --model flags, and how the router
maps a request's `model` to its model's group (in-process: no engine runs)."""

import asyncio

import pytest

from pd_plugins.routers.cli import build_parser, config_from_args
from pd_plugins.routers.config import (
    ConfigError, ModelSpec, RouterConfig, WorkerConflict, WorkerSpec, config_from_mapping,
    default_discovery_label, is_label_value,
)
from pd_plugins.routers.model_group import ModelNotFound
from pd_plugins.routers.request import BadRequest
from pd_plugins.routers.server import Router

P1, D1, P2, D2 = (f"http://127.0.0.1:{port}" for port in (8101, 8201, 8102, 8202))


def flags(*argv: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def two_models(**top) -> RouterConfig:
    return config_from_mapping({"models": [
        {"name": "m1", "prefill": [{"url": P1}], "decode": [{"url": D1}]},
        {"name": "org/m2", "decode": [{"url": D2}], "block_size": 32}], **top})


def test_model_flags_take_the_workers_that_follow_them():
    cfg = flags("--policy", "least_loaded",
                "--model", "m1", "--prefill", P1, "--decode", D1,
                "--model", "org/m2", "policy=prefix_cache", "block_size=32", "transfer=push",
                "discovery_label=m2", "--decode", D2, "--prefill", P2, "engine_id=p0", "kv_port=5600")
    m1, m2 = cfg.models
    assert (m1.name, [w.url for w in m1.prefill], [w.url for w in m1.decode]) == ("m1", [P1], [D1])
    assert (m2.name, [w.url for w in m2.prefill], [w.url for w in m2.decode]) == ("org/m2", [P2], [D2])
    assert m2.prefill[0].engine_id == "p0" and m2.block_size == 32 and m2.transfer == "push"
    assert cfg.prefill == [] and cfg.decode == []
    # unset options come from the top level; a model's own policy preset is resolved
    r1, r2 = cfg.model_groups()
    assert r1.policy == cfg.policy and r1.transfer == "pull" and r1.block_size == cfg.block_size
    assert r2.policy.prefill.scorers[0].name == "prefix_cache"
    assert cfg.policy.prefill.scorers[0].name == "least_loaded"
    assert (m1.pod_label, m2.pod_label) == ("m1", "m2")


def test_yaml_models_and_flags_replacing_them(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(f"""
models:
  - name: Qwen/Qwen2.5-0.5B-Instruct
    decode: [{{url: "{D1}"}}]
    policy: least_loaded
  - name: m2
    prefill: [{{url: "{P2}"}}]
    decode: [{{url: "{D2}"}}]
""")
    cfg = flags("--config", str(path))
    assert [m.name for m in cfg.models] == ["Qwen/Qwen2.5-0.5B-Instruct", "m2"]
    assert cfg.models[0].policy.decode.scorers[0].name == "least_loaded"
    assert cfg.models[1].policy is None  # the top level's
    assert cfg.models[0].pod_label == "Qwen-Qwen2.5-0.5B-Instruct"
    replaced = flags("--config", str(path), "--model", "only", "--decode", D1)
    assert [m.name for m in replaced.models] == ["only"]


def test_without_models_the_top_level_workers_are_one_unnamed_model():
    cfg = flags("--prefill", P1, "--decode", D1)
    (group,) = cfg.model_groups()
    assert group.name == "" and [w.url for w in group.decode] == [D1]
    assert Router(cfg).groups.keys() == {""}


def test_discovery_label_default_is_a_label_safe_slug():
    assert default_discovery_label("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen-Qwen2.5-0.5B-Instruct"
    assert default_discovery_label("a b:c@d_e.f") == "a-b-c-d_e.f"
    assert ModelSpec(name="x/y", discovery_label="custom").pod_label == "custom"


@pytest.mark.parametrize("argv, message", [
    (("--decode", D1, "--model", "m1"), "comes before the first --model"),
    (("--model", "m1", "--decode", D1, "--model", "m1", "--decode", D2), "listed twice"),
    (("--model", "m1", "--prefill", P1, "--model", "m2", "--decode", D2), "'m1' has no decode worker"),
    (("--model", "m1", "--decode", D1, "--model", "m2", "--decode", D1), "is in models 'm1' and 'm2'"),
    (("--model", "m 1", "--decode", D1), "without spaces"),
    (("--model", "", "--decode", D1), "printable ASCII"),
    (("--model", "m1", "oops", "--decode", D1), "expected KEY=VALUE"),
    (("--model", "m1", "colour=red", "--decode", D1), r"unknown field `colour` - at `\$.models\[0\]`"),
    (("--model", "m1", "policy=best", "--decode", D1), "unknown policy 'best'"),
    (("--model", "m1", "block_size=0", "--decode", D1),
     r"Expected `int` >= 1 - at `\$.models\[0\].block_size`"),
    (("--model", "m1", "--decode", D1, "--mode", "sidecar"), "cannot serve `models:`"),
    (("--model", "m1", "transfer=push", "--prefill", P1, "--decode", D1), "model 'm1': prefill .* needs engine_id"),
])
def test_invalid_model_configurations_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        flags(*argv)


def test_models_and_top_level_workers_do_not_mix():
    with pytest.raises(ConfigError, match="move the top-level prefill/decode workers"):
        config_from_mapping({"decode": [{"url": D1}], "models": [{"name": "m", "decode": [{"url": D2}]}]})


def test_discovery_relaxes_the_decode_rule():
    """The hook the Kubernetes discovery uses: with workers found later, a model (or the router)
    may start without any."""
    discovery = {"kind": "kubernetes"}
    assert config_from_mapping({"discovery": discovery, "models": [{"name": "m"}]}).models[0].decode == []
    assert config_from_mapping({"discovery": discovery}).decode == []
    with pytest.raises(ConfigError, match="'m' has no decode worker"):
        config_from_mapping({"models": [{"name": "m"}]})


# -- the name -> group table ------------------------------------------------------------------

def serve(group, *names, parents=None):
    """Pretend the group's workers passed their probes and listed `names` in /v1/models."""
    for worker in group.pool:
        worker.healthy, worker.models = True, names
        worker.adapter_parents = dict(parents or {})
        worker.max_model_len = 2048


def test_requests_find_their_model_and_adapters():
    router = Router(two_models())
    m1, m2 = router.groups["m1"], router.groups["org/m2"]
    assert router.select_model("m1") is m1 and router.select_model("org/m2") is m2
    serve(m1, "m1", "m1-lora-a", parents={"m1-lora-a": "m1"})
    serve(m2, "org/m2", "m1")  # a name m1 is configured with stays m1's
    router.refresh_served()
    assert router.select_model("m1-lora-a") is m1 and router.select_model("m1") is m1
    assert m1.adapter_parents == {"m1-lora-a": "m1"} and m1.max_model_len == 2048
    assert m2.spec.block_size == 32 and m1.spec.block_size == 16
    with pytest.raises(BadRequest) as unknown:
        router.select_model("m3")
    assert unknown.value.status == 404
    assert "available: m1, m1-lora-a, org/m2" in unknown.value.message
    with pytest.raises(BadRequest) as missing:
        router.select_model(None)
    assert missing.value.status == 400 and "'model' is required" in missing.value.message


def test_a_model_serves_only_its_own_adapters():
    """Each engine answers /v1/models as vLLM does (adapters with their base as `parent`), read
    by the router's own health probe. m1's engine lists, besides "m1": an adapter of org/m2's
    model, an extra base name, and an adapter of that base name (vLLM names an adapter's parent
    by the first --served-model-name); only the last is m1's. org/m2's adapter goes to org/m2,
    not to m1 (first in the config), which used to take every name its workers listed."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from pd_plugins.routers.health import PoolUpkeep
    from pd_plugins.routers.upstream import new_session

    def engine(*cards):
        async def models(request):
            return web.json_response({"object": "list", "data": [
                {"id": name, "object": "model", "parent": parent, "max_model_len": 2048}
                for name, parent in cards]})
        app = web.Application()
        app.router.add_get("/v1/models", models)
        return TestServer(app)

    m1_engine = engine(("m1-full", None), ("m1", None), ("m1-sql", "m1-full"),
                       ("m2-sql", "org/m2"), ("org/m2", "m1-full"))
    m2_engine = engine(("org/m2", None), ("m2-sql", "org/m2"))

    async def main():
        for server in (m1_engine, m2_engine):
            await server.start_server()
        try:
            router = Router(config_from_mapping({
                "models": [{"name": "m1", "decode": [{"url": str(m1_engine.make_url(""))}]},
                           {"name": "org/m2", "decode": [{"url": str(m2_engine.make_url(""))}]}],
                "health": {"canary": False}}))
            session = new_session(5.0)
            try:
                await PoolUpkeep(router.config, router.workers, session).check_all()
            finally:
                await session.close()
            assert all(w.healthy for w in router.workers)
            router.refresh_served()
        finally:
            for server in (m1_engine, m2_engine):
                await server.close()
        m1, m2 = router.groups["m1"], router.groups["org/m2"]
        assert m1.served == {"m1", "m1-sql"} and m1.adapter_parents == {"m1-sql": "m1-full"}
        assert m2.served == {"org/m2", "m2-sql"}
        assert router.select_model("m2-sql") is m2 and router.select_model("m1-sql") is m1
        assert router.select_model("org/m2") is m2
        with pytest.raises(BadRequest):
            router.select_model("m1-full")  # a named model answers to its configured name

    asyncio.run(main())


def test_a_single_named_model_takes_requests_without_a_model():
    router = Router(config_from_mapping({"models": [{"name": "m1", "decode": [{"url": D1}]}]}))
    assert router.select_model(None) is router.groups["m1"] is router.group_for(None)
    with pytest.raises(BadRequest, match="available: m1"):
        router.select_model("m2")


def test_a_model_whose_workers_are_down_still_answers_to_its_name():
    router = Router(two_models())
    serve(router.groups["m1"], "m1", "m1-lora-a")
    router.refresh_served()
    for worker in router.groups["m1"].pool:
        worker.healthy = False
    router.refresh_served()
    assert router.select_model("m1") is router.groups["m1"]  # then 503: no healthy decode
    with pytest.raises(BadRequest):
        router.select_model("m1-lora-a")


def test_one_unnamed_group_behaves_as_before():
    router = Router(RouterConfig(decode=[WorkerSpec(url=D1)]).validate())
    (group,) = router.groups.values()
    assert router.select_model(None) is group and router.select_model("anything") is group
    serve(group, "mock")
    router.refresh_served()
    assert router.select_model(None) is group and router.select_model("mock") is group
    with pytest.raises(BadRequest, match="not served here; available: mock"):
        router.select_model("other")
    assert router.group_for(None) is group and router.group_for("mock") is group


def test_admin_lookups_name_the_known_models():
    router = Router(two_models())
    with pytest.raises(ModelNotFound) as missing:
        router.group_for(None)
    assert missing.value.status == 400
    with pytest.raises(ModelNotFound, match="available: m1, org/m2") as unknown:
        router.group_for("nope")
    assert unknown.value.status == 404
    # removing without a model finds the worker in whichever model has it
    removed = router.remove_worker(D2, "decode")
    assert removed is not None and removed.model == "org/m2" and removed.draining
    assert router.groups["org/m2"].pool.get(D2, "decode") is None
    assert router.remove_worker(D2, "decode") is None
    with pytest.raises(ModelNotFound):
        router.remove_worker(D1, "decode", model="nope")


def test_a_removed_workers_connection_pool_is_shut_and_dropped():
    # workers that come and go (discovery) must not pile up pools and their sockets
    router = Router(two_models())
    pool = router.pools.get(D2)
    assert D2 in router.pools._pools and not pool.closed
    removed = router.remove_worker(D2, "decode")
    assert D2 not in router.pools._pools and pool.closed
    # its request in flight (a decode leg after its prefill) gets a pool nobody keeps
    late = router.pools.of(removed)
    assert late.closed and D2 not in router.pools._pools
    # a kv_both URL still serving its other role keeps its pool
    both = Router(config_from_mapping({"prefill": [{"url": P1, "kv_both": True}],
                                       "decode": [{"url": P1, "kv_both": True}, {"url": D1}]}))
    kept = both.pools.get(P1)
    both.remove_worker(P1, "prefill")
    assert both.pools._pools.get(P1) is kept and not kept.closed


def test_a_shared_pool_no_worker_names_any_more_is_closed_and_dropped(tmp_path):
    pool = str(tmp_path / "pool")  # a PdShm pool's view (none there yet: it maps when made)
    router = Router(config_from_mapping({"decode": [{"url": D1, "kv_pool": pool},
                                                    {"url": D2, "kv_pool": pool}]}))
    group = router.groups[""]
    for worker in group.pool:
        group.subscribe(worker, router._pool_views)
    view = router._pool_views[pool]
    closed = []
    view.close = lambda: closed.append(True)
    router.remove_worker(D1, "decode")
    assert router._pool_views.get(pool) is view and not closed  # D2 still reads it
    router.remove_worker(D2, "decode")
    assert pool not in router._pool_views and closed == [True]


def test_adding_a_worker_to_a_model():
    router = Router(two_models())
    worker = asyncio.run(router.add_worker(WorkerSpec(url=P2), "prefill", model="org/m2"))
    assert worker.model == "org/m2" and router.groups["org/m2"].pool.get(P2, "prefill") is worker
    assert not worker.usable  # until its first probe passes
    with pytest.raises(ConfigError, match="already serves model 'org/m2'"):
        asyncio.run(router.add_worker(WorkerSpec(url=P2), "prefill", model="m1"))
    with pytest.raises(ModelNotFound):
        asyncio.run(router.add_worker(WorkerSpec(url="http://127.0.0.1:9"), "decode"))


# -- refused at startup: what would silently mix two models --------------------------------------

DISCOVERY = {"kind": "kubernetes"}


def test_pod_labels_must_be_distinct_label_values_with_discovery():
    def models(*entries):
        return config_from_mapping({"discovery": DISCOVERY, "models": list(entries)})

    with pytest.raises(ConfigError, match="'org/m' and 'org-m' both have the pod label 'org-m'.*"
                                          "discovery_label"):
        models({"name": "org/m"}, {"name": "org-m"})
    long_name = "org/" + "x" * 70
    with pytest.raises(ConfigError, match="no Kubernetes label value.*set `discovery_label`"):
        models({"name": long_name})
    for bad in ("-m", "m.", "_x"):  # what the default slug can still produce
        with pytest.raises(ConfigError, match="no Kubernetes label value"):
            models({"name": bad})
    with pytest.raises(ConfigError, match="no Kubernetes label value"):
        models({"name": "m", "discovery_label": "bad/label"})
    # discovery_label settles both
    ok = models({"name": "org/m"}, {"name": "org-m", "discovery_label": "m2"},
                {"name": long_name, "discovery_label": "long"})
    assert [m.pod_label for m in ok.models] == ["org-m", "m2", "long"]
    # without discovery the label is unused: any valid model name stands
    plain = config_from_mapping({"models": [{"name": long_name, "decode": [{"url": D1}]},
                                            {"name": "-m", "decode": [{"url": D2}]}]})
    assert [m.name for m in plain.models] == [long_name, "-m"]


def test_label_rule_matches_kubernetes():
    assert is_label_value("Qwen-Qwen2.5-0.5B-Instruct") and is_label_value("a") and is_label_value("x" * 63)
    for bad in ("", "x" * 64, "-a", "a-", "_a", "a.", "a/b", "a b", "é"):
        assert not is_label_value(bad), bad


def test_models_do_not_inherit_the_top_level_tokenizer(tmp_path):
    cfg = config_from_mapping({"tokenizer": str(tmp_path), "block_size": 32, "models": [
        {"name": "m1", "decode": [{"url": D1}]},
        {"name": "m2", "decode": [{"url": D2}], "tokenizer": "/models/m2"}]})
    r1, r2 = cfg.model_groups()
    assert r1.tokenizer is None and r1.block_size == 32  # the block size still comes down
    assert r2.tokenizer == "/models/m2"
    # without models: the one unnamed model takes the top-level tokenizer, as before
    (only,) = config_from_mapping({"tokenizer": "/t", "decode": [{"url": D1}]}).model_groups()
    assert only.tokenizer == "/t"


def test_the_old_list_of_served_names_is_refused_clearly():
    with pytest.raises(ConfigError, match=r"no longer a list of served names.*models: \[\{name: "
                                          r"\.\.\., prefill: \[\.\.\.\], decode: \[\.\.\.\]\}\].*"
                                          "omit `models:`"):
        config_from_mapping({"decode": [{"url": D1}], "models": ["m1", "m2"]})


def test_one_engine_or_kv_pool_in_two_models_is_refused():
    with pytest.raises(ConfigError, match=f"worker {P1} is in models 'm1' and 'm2'.*either role"):
        config_from_mapping({"models": [
            {"name": "m1", "prefill": [{"url": P1}], "decode": [{"url": D1}]},
            {"name": "m2", "decode": [{"url": P1}]}]})
    with pytest.raises(ConfigError, match="kv_pool 'lmcache:pool' is in models 'm1' and 'm2'"):
        config_from_mapping({"models": [
            {"name": "m1", "decode": [{"url": D1, "kv_pool": "lmcache:pool"}]},
            {"name": "m2", "decode": [{"url": D2, "kv_pool": "lmcache:pool"}]}]})
    # one pool within a model is what pools are for
    config_from_mapping({"models": [{"name": "m1", "prefill": [{"url": P1, "kv_pool": "lmcache:a"}],
                                     "decode": [{"url": D1, "kv_pool": "lmcache:a"}]}]})


def test_workers_added_while_serving_follow_the_same_rules():
    router = Router(config_from_mapping({"models": [
        {"name": "m1", "decode": [{"url": D1, "kv_pool": "lmcache:m1"}]},
        {"name": "m2", "decode": [{"url": D2}]}]}))
    with pytest.raises(WorkerConflict, match=f"worker {D1} already serves model 'm1'"):
        asyncio.run(router.add_worker(WorkerSpec(url=D1), "prefill", model="m2"))  # other role
    with pytest.raises(WorkerConflict, match="kv_pool 'lmcache:m1' already holds model 'm1'"):
        asyncio.run(router.add_worker(WorkerSpec(url=P2, kv_pool="lmcache:m1"), "prefill", model="m2"))
    asyncio.run(router.add_worker(WorkerSpec(url=P1, kv_pool="lmcache:m1"), "prefill", model="m1"))
    assert router.groups["m1"].pool.get(P1, "prefill") is not None


def test_model_not_found_is_a_lookup_not_a_config_error():
    router = Router(two_models())
    with pytest.raises(ModelNotFound) as missing:
        router.group_for("nope")
    assert isinstance(missing.value, LookupError) and not isinstance(missing.value, ConfigError)


def test_an_unused_top_level_tokenizer_is_logged(caplog, monkeypatch):
    cfg = config_from_mapping({"tokenizer": "/t", "models": [
        {"name": "m1", "decode": [{"url": D1}], "tokenizer": "/t1"},
        {"name": "m2", "decode": [{"url": D2}]}]})
    monkeypatch.setattr("pd_plugins.routers.server.load_tokenizer", lambda path: len)  # no file
    router = Router(cfg)
    assert router.groups["m1"].tokenize is not None and router.groups["m2"].tokenize is None
    assert "model(s) m2 have none of their own" in caplog.text
