"""Kubernetes discovery (routers/discovery/): pods to workers, the label selector, which API and
namespace, and the watcher's list/watch/re-list logic against the FAKE Kubernetes API server
(pd_plugins/testing/fake_kube_api.py, in a thread of this process) with a recording sink."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from lightkube.resources.core_v1 import Pod

from pd_plugins.routers.config import ConfigError, DiscoverySpec, default_discovery_label
from pd_plugins.routers.discovery import kubernetes_watcher, plan_kubernetes
from pd_plugins.routers.discovery.kube_config import select_kube_config
from pd_plugins.routers.discovery.pods import NotAWorker, pod_worker
from pd_plugins.routers.discovery.selector import parse_label_selector
from pd_plugins.testing.fake_kube_api import FakeKubeApi, make_pod, selector_matches, set_ready

SELECTOR = "app.kubernetes.io/part-of=pd-plugins"


def pod(name="p", role="decode", ip="10.1.2.3", **kw) -> Pod:
    raw = make_pod(name, role, ip, **kw)
    raw["metadata"]["uid"] = f"uid-{name}"
    return Pod.from_dict(raw)


# -- a pod as a worker -------------------------------------------------------------------------
def test_pod_maps_role_model_url_and_annotations():
    notes = {"pd-plugins.io/kv-port": "5600", "pd-plugins.io/engine-id": "p0",
             "pd-plugins.io/bootstrap-port": "8998", "pd-plugins.io/kv-events-port": "5557",
             "pd-plugins.io/kv-events-replay-port": "5558"}
    worker = pod_worker(pod(role="prefill", model="Qwen-Qwen2.5-0.5B-Instruct", http_port=8100,
                            annotations=notes), {"Qwen-Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert (worker.role, worker.model) == ("prefill", "Qwen/Qwen2.5-0.5B-Instruct")
    spec = worker.spec
    assert spec.url == "http://10.1.2.3:8100"
    assert (spec.kv_port, spec.engine_id, spec.bootstrap_port) == (5600, "p0", 8998)
    assert spec.kv_events == "tcp://10.1.2.3:5557"
    assert spec.kv_events_replay == "tcp://10.1.2.3:5558"
    plain = pod_worker(pod(ip="fd00::7"), None)  # defaults; IPv6 in brackets; one unnamed group
    assert plain.spec.url == "http://[fd00::7]:8000" and plain.model is None
    assert plain.spec.kv_port is None and plain.spec.kv_events is None
    assert plain.spec.kv_events_replay is None
    assert plain.spec.engine_id is None
    # a prefill pod without the annotation: its pod name (push mode's engine id by downward API)
    assert pod_worker(pod("prefill-7f9c", role="prefill"), None).spec.engine_id == "prefill-7f9c"


def test_only_ready_pods_with_an_ip_not_being_deleted_are_workers():
    assert pod_worker(pod(ready=False), None) is None
    assert pod_worker(pod(ip=None), None) is None
    deleting = make_pod("p", "decode", "10.0.0.1")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_worker(Pod.from_dict(deleting), None) is None
    assert pod_worker(pod(), None) is not None


def test_pods_that_cannot_be_workers_say_why():
    with pytest.raises(NotAWorker, match="pd.role='router'"):
        pod_worker(pod(role="router"), None)
    with pytest.raises(NotAWorker, match="names no configured model"):
        pod_worker(pod(model="other"), {"mine": "mine"})
    with pytest.raises(NotAWorker, match="names no configured model"):  # named groups: label needed
        pod_worker(pod(), {"mine": "mine"})
    with pytest.raises(NotAWorker, match="not a port"):
        pod_worker(pod(annotations={"pd-plugins.io/http-port": "80a"}), None)
    with pytest.raises(NotAWorker, match="not a port"):
        pod_worker(pod(annotations={"pd-plugins.io/kv-port": "70000"}), None)
    # digits to str.isdigit() that int() refuses, or too many: still just not a port (a raw
    # ValueError had stopped discovery for good, relisting the same pod forever)
    for raw in ("²", "٣", "9" * 5000):
        with pytest.raises(NotAWorker, match="not a port"):
            pod_worker(pod(annotations={"pd-plugins.io/kv-events-port": raw}), None)
    with pytest.raises(NotAWorker, match="kv_events_replay needs kv_events"):
        pod_worker(pod(annotations={"pd-plugins.io/kv-events-replay-port": "5558"}), None)
    # one unnamed group takes any pd.model
    assert pod_worker(pod(model="whatever"), None).model is None


def test_default_label_keeps_only_label_characters():
    assert default_discovery_label("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen-Qwen2.5-0.5B-Instruct"
    assert default_discovery_label("a b:c_d") == "a-b-c_d"


# -- the selector ------------------------------------------------------------------------------
def test_selector_forms_round_trip_through_the_client_and_the_fake():
    from lightkube.core.selector import build_selector

    text = "app.kubernetes.io/part-of=pd-plugins,pd.role in (prefill, decode),!legacy,tier!=x,zone"
    encoded = build_selector(parse_label_selector(text))
    labels = {"app.kubernetes.io/part-of": "pd-plugins", "pd.role": "decode", "zone": "a"}
    assert selector_matches(encoded, labels)
    assert not selector_matches(encoded, {**labels, "legacy": "1"})
    assert not selector_matches(encoded, {**labels, "pd.role": "router"})
    assert not selector_matches(encoded, {k: v for k, v in labels.items() if k != "zone"})


@pytest.mark.parametrize("bad", ["", "a=b,,c", "a in b", "a=(b)", "=x", "a>1"])
def test_bad_selectors_are_config_errors(bad):
    with pytest.raises(ConfigError):
        parse_label_selector(bad)


# -- which API, which namespace ----------------------------------------------------------------
def _kubeconfig(path: Path, server: str, namespace: str | None = None) -> Path:
    ctx = {"cluster": "c", "user": "u", **({"namespace": namespace} if namespace else {})}
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        f"contexts: [{{name: c, context: {ctx}}}]\n".replace("'", '"'))
    return path


@pytest.fixture
def service_account(tmp_path):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "namespace").write_text("engines")
    (sa / "ca.crt").write_text("")
    return sa


def test_in_cluster_config_when_in_a_pod(monkeypatch, service_account, tmp_path):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "kc", "http://ignored:1")))
    target = select_kube_config(service_account=service_account)
    assert (target.source, target.server, target.namespace) == \
        ("in-cluster", "https://10.96.0.1:443", "engines")
    assert target.config.user.token_file == str(service_account / "token")  # rotated tokens re-read
    assert select_kube_config(namespace="other", service_account=service_account).namespace == "other"
    # an explicit kubeconfig wins even in a pod
    explicit = _kubeconfig(tmp_path / "explicit", "http://127.0.0.1:9", "ns1")
    chosen = select_kube_config(str(explicit), service_account=service_account)
    assert (chosen.server, chosen.namespace) == ("http://127.0.0.1:9", "ns1")


def test_kubeconfig_outside_a_pod(monkeypatch, service_account, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # a token alone is not a pod
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "kc", "https://api.example:6443")))
    target = select_kube_config(service_account=service_account)
    assert (target.server, target.namespace, target.source) == \
        ("https://api.example:6443", "default", str(tmp_path / "kc"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # a host but no token: not a pod
    assert select_kube_config(service_account=tmp_path / "none").server == "https://api.example:6443"


def test_no_config_at_all_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="give --kubeconfig"):
        select_kube_config(service_account=tmp_path / "none")
    (tmp_path / "broken").write_text("clusters: [")
    with pytest.raises(ConfigError, match="kubernetes discovery"):
        select_kube_config(str(tmp_path / "broken"))
    with pytest.raises(ConfigError, match="not found"):
        select_kube_config(str(tmp_path / "absent"))


# -- the watcher against the fake API ------------------------------------------------------------
class Recorder:
    """The router's side of discovery, recorded."""

    def __init__(self, add_delay_s: float = 0.0) -> None:
        self.workers: dict[tuple, object] = {}
        self.calls: list[tuple] = []
        self.add_delay_s = add_delay_s

    async def add_worker(self, spec, role, model=None):
        await asyncio.sleep(self.add_delay_s)  # the router probes the new worker meanwhile
        self.calls.append(("add", spec.url, role, model))
        self.workers[(spec.url, role, model)] = spec
        return spec

    def remove_worker(self, url, role, model=None):
        self.calls.append(("remove", url, role, model))
        return self.workers.pop((url, role, model), None)

    def urls(self, role: str = "decode") -> set[str]:
        return {url for url, r, _ in self.workers if r == role}


async def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
def api(tmp_path):
    with FakeKubeApi() as fake:
        fake.kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
        yield fake


def run(api: FakeKubeApi, scenario, sink=None, **options):
    async def main():
        recorder = sink or Recorder()
        models = options.pop("models", None)
        plan = plan_kubernetes(DiscoverySpec(selector=SELECTOR, kubeconfig=str(api.kubeconfig),
                                             **options))
        watcher = kubernetes_watcher(recorder, plan, models)
        watcher.retry_initial_s, watcher.retry_max_s = 0.05, 0.2
        watcher.start()
        try:
            await asyncio.wait_for(scenario(watcher, recorder), 30)
        finally:
            await watcher.stop()
    asyncio.run(main())


def test_ready_pods_are_added_and_leave_when_not_ready_deleted_or_deleting(api):
    api.add_pod(make_pod("a", "decode", "127.0.0.2"))
    api.add_pod(make_pod("b", "decode", "127.0.0.3", ready=False))
    api.add_pod(make_pod("c", "prefill", "127.0.0.4", labels={"app.kubernetes.io/part-of": "x"}))

    async def scenario(watcher, rec):
        await until(lambda: rec.urls() == {"http://127.0.0.2:8000"}, what="the Ready pod")
        assert rec.urls("prefill") == set()  # c is not selected
        api.update_pod("b", lambda p: set_ready(p, True))
        await until(lambda: "http://127.0.0.3:8000" in rec.urls(), what="b once Ready")
        api.update_pod("a", lambda p: set_ready(p, False))
        await until(lambda: "http://127.0.0.2:8000" not in rec.urls(), what="a not Ready")
        api.update_pod("a", lambda p: set_ready(p, True))
        await until(lambda: "http://127.0.0.2:8000" in rec.urls(), what="a Ready again")
        api.update_pod("a", lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"))
        await until(lambda: "http://127.0.0.2:8000" not in rec.urls(), what="a deleting")
        api.delete_pod("b")
        await until(lambda: rec.urls() == set(), what="b deleted")
        assert watcher.counts["lists"] == 1  # all by watch events

    run(api, scenario)


def test_changed_address_is_removed_then_added(api):
    api.add_pod(make_pod("a", "prefill", "127.0.0.2", annotations={"pd-plugins.io/kv-port": "5600"}))

    async def scenario(watcher, rec):
        await until(lambda: rec.urls("prefill") == {"http://127.0.0.2:8000"})
        api.update_pod("a", lambda p: p["metadata"]["annotations"].update(
            {"pd-plugins.io/kv-port": "5601"}))
        await until(lambda: len(rec.calls) == 3, what="remove and add")
        assert rec.calls[1:] == [("remove", "http://127.0.0.2:8000", "prefill", None),
                                 ("add", "http://127.0.0.2:8000", "prefill", None)]
        assert rec.workers[("http://127.0.0.2:8000", "prefill", None)].kv_port == 5601
        api.update_pod("a", lambda p: p["status"].update(podIP="127.0.0.9"))
        await until(lambda: rec.urls("prefill") == {"http://127.0.0.9:8000"}, what="new IP")
        # a change that is not the router's business (a label) changes nothing
        calls = len(rec.calls)
        api.update_pod("a", lambda p: p["metadata"]["labels"].update(extra="1"))
        api.add_pod(make_pod("z", "decode", "127.0.0.5"))  # a marker event after it
        await until(lambda: "http://127.0.0.5:8000" in rec.urls())
        assert len(rec.calls) == calls + 1

    run(api, scenario)


def test_watch_expiry_resumes_from_the_last_version_without_losing_events(api):
    api.add_pod(make_pod("a", "decode", "127.0.0.2"))

    async def scenario(watcher, rec):
        await until(lambda: rec.urls() == {"http://127.0.0.2:8000"})
        await until(lambda: api.count("watch") == 1, what="the first watch")
        for i in range(3):
            assert api.expire_watches() == 1
            api.add_pod(make_pod(f"n{i}", "decode", f"127.0.1.{i}"))  # while no watch is open
            await until(lambda: f"http://127.0.1.{i}:8000" in rec.urls(), what=f"n{i}")
        assert watcher.counts["lists"] == 1  # resumed, never re-listed
        versions = [int(params["resourceVersion"]) for kind, params in api.requests if kind == "watch"]
        assert len(versions) == 4 and versions == sorted(versions)

    run(api, scenario)


def test_gone_after_compaction_relists_and_reconciles(api):
    api.add_pod(make_pod("a", "decode", "127.0.0.2"))
    api.add_pod(make_pod("b", "decode", "127.0.0.3"))

    async def scenario(watcher, rec):
        await until(lambda: len(rec.urls()) == 2)
        await until(lambda: api.count("watch") == 1, what="the first watch")
        # changes whose events the watcher misses, then the history is compacted away
        api.quietly(lambda: (api.delete_pod("a"), api.add_pod(make_pod("c", "decode", "127.0.0.4")),
                             api.update_pod("b", lambda p: set_ready(p, False))))
        api.compact()
        api.expire_watches()
        await until(lambda: rec.urls() == {"http://127.0.0.4:8000"}, what="the re-listed set")
        assert watcher.counts["gone"] == 1 and watcher.counts["lists"] == 2
        assert watcher.counts["api_errors"] == 0
        api.add_pod(make_pod("d", "decode", "127.0.0.5"))  # and it watches again
        await until(lambda: "http://127.0.0.5:8000" in rec.urls())

    run(api, scenario)


def test_gone_on_every_watch_backs_off_instead_of_spinning(api):
    api.add_pod(make_pod("a", "decode", "127.0.0.2"))

    async def scenario(watcher, rec):
        await until(lambda: rec.workers)
        api._call(lambda: setattr(api, "oldest_kept", 10**9))  # a broken API: always 410
        api.expire_watches()
        await asyncio.sleep(1.5)
        assert 2 <= watcher.counts["gone"] <= 20, watcher.counts  # backoff 0.05 .. 0.2 s
        assert rec.workers and not any(c[0] == "remove" for c in rec.calls)

    run(api, scenario)


@pytest.mark.parametrize("mode", ["refuse", "error"])
def test_outage_keeps_the_known_set_and_recovers(api, mode, caplog):
    api.add_pod(make_pod("a", "decode", "127.0.0.2"))
    api.add_pod(make_pod("b", "prefill", "127.0.0.3"))

    async def scenario(watcher, rec):
        await until(lambda: len(rec.workers) == 2)
        await until(lambda: api.count("watch") == 1, what="the first watch")
        api.start_outage(mode)
        await until(lambda: watcher.counts["api_errors"] >= 4, what="several failed retries")
        assert len(rec.workers) == 2 and not any(c[0] == "remove" for c in rec.calls)
        api.quietly(lambda: (api.delete_pod("a"), api.add_pod(make_pod("c", "decode", "127.0.0.4"))))
        api.end_outage()
        await until(lambda: rec.urls() == {"http://127.0.0.4:8000"}, what="reconciled after outage")
        assert rec.urls("prefill") == {"http://127.0.0.3:8000"}

    with caplog.at_level(logging.INFO, logger="pd_router.discovery"):
        run(api, scenario)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("API unusable" in m for m in messages) == 1, messages  # once per outage
    assert sum("API back" in m for m in messages) == 1


def test_removal_while_the_add_still_probes_cancels_it(api):
    api.add_pod(make_pod("a", "decode", "127.0.0.2"))

    async def scenario(watcher, rec):
        await until(lambda: watcher.pods, what="a known")
        api.delete_pod("a")  # its add is still sleeping (probing)
        await until(lambda: not watcher.pods and not watcher._adding, what="a forgotten")
        await asyncio.sleep(0.3)
        assert rec.workers == {}

    run(api, scenario, sink=Recorder(add_delay_s=5.0))


def test_bounds_and_ignored_pods_log_once(api, caplog):
    for i in range(4):
        api.add_pod(make_pod(f"p{i}", "decode", f"127.0.2.{i}"))
    api.add_pod(make_pod("odd", "router", "127.0.3.1"))

    async def scenario(watcher, rec):
        await until(lambda: len(rec.workers) == 3, what="max_pods workers")
        for i in range(3):
            api.update_pod("odd", lambda p: p["metadata"]["labels"].update(n=str(i)))
        (waiting,) = {f"http://127.0.2.{i}:8000" for i in range(4)} - rec.urls()
        api.delete_pod(sorted(rec.urls())[0].replace("http://127.0.2.", "p").split(":")[0])
        # room for one more: the pod that waited joins, with no event of its own
        await until(lambda: waiting in rec.urls(), what="the waiting pod")
        assert len(rec.workers) == 3 and len(watcher.pods) == 3 and not watcher._waiting

    with caplog.at_level(logging.INFO, logger="pd_router.discovery"):
        run(api, scenario, max_pods=3)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("pod default/odd ignored" in m for m in messages) == 1, messages
    assert sum("more than 3 worker pods" in m for m in messages) == 1


def test_models_by_label(api):
    api.add_pod(make_pod("q", "decode", "127.0.0.2", model="Qwen-Qwen2.5-0.5B-Instruct"))
    api.add_pod(make_pod("l", "decode", "127.0.0.3", model="llama"))
    api.add_pod(make_pod("x", "decode", "127.0.0.4"))  # no pd.model: ignored with named groups

    async def scenario(watcher, rec):
        await until(lambda: len(rec.workers) == 2)
        await asyncio.sleep(0.2)
        assert set(rec.workers) == {("http://127.0.0.2:8000", "decode", "Qwen/Qwen2.5-0.5B-Instruct"),
                                    ("http://127.0.0.3:8000", "decode", "llama")}

    run(api, scenario, models={"Qwen-Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct",
                               "llama": "llama"})


def test_api_token_is_required(api, tmp_path):
    """The kubeconfig's credentials reach the API (a wrong token is an API error, retried)."""
    api.add_pod(make_pod("a", "decode", "127.0.0.2"))
    api.token = "changed"

    async def scenario(watcher, rec):
        await until(lambda: watcher.counts["api_errors"] >= 2)
        assert rec.workers == {}
        api.token = "fake-kube-token"
        await until(lambda: len(rec.workers) == 1)

    run(api, scenario)


# -- the router's configuration and wiring -------------------------------------------------------
def test_flags_and_yaml_configure_discovery(tmp_path, monkeypatch):
    from pd_plugins.routers.cli import build_parser, config_from_args

    kubeconfig = _kubeconfig(tmp_path / "kc", "http://127.0.0.1:9", "ns-from-context")
    config = config_from_args(build_parser().parse_args([
        "--discovery", "kubernetes", "--kubeconfig", str(kubeconfig), "--k8s-selector", "a=b"]))
    assert config.decode == [] and config.discovery.selector == "a=b"
    assert config.discovery.kubeconfig == str(kubeconfig) and config.discovery.namespace is None
    (tmp_path / "router.yaml").write_text(
        f"discovery: {{kubeconfig: {kubeconfig}, max_pods: 5}}\n"
        "models: [{name: m1}, {name: m2, discovery_label: other}]\n")
    config = config_from_args(build_parser().parse_args([
        "--config", str(tmp_path / "router.yaml"), "--k8s-namespace", "engines"]))
    assert (config.discovery.namespace, config.discovery.max_pods) == ("engines", 5)
    with pytest.raises(ConfigError, match="need --discovery"):
        config_from_args(build_parser().parse_args(["--k8s-namespace", "x", "--decode", "http://d:1"]))
    with pytest.raises(ConfigError, match="sidecar"):
        config_from_args(build_parser().parse_args([
            "--discovery", "kubernetes", "--kubeconfig", str(kubeconfig), "--mode", "sidecar",
            "--decode", "http://d:1"]))
    with pytest.raises(ConfigError, match="not a label selector"):
        config_from_args(build_parser().parse_args([
            "--discovery", "kubernetes", "--kubeconfig", str(kubeconfig), "--k8s-selector", "a b"]))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="give --kubeconfig"):  # --check-config catches it
        config_from_args(build_parser().parse_args(["--discovery", "kubernetes"]))


def test_router_puts_pods_into_models_by_label(api):
    """The real Router (in-process, no engines behind the pods: they stay unprobed-down) gets
    each pod into the model its pd.model label names."""
    from aiohttp import web

    from pd_plugins.routers.config import config_from_mapping
    from pd_plugins.routers.server import Router
    from pd_plugins.testing.processes import free_port

    ports = [free_port() for _ in range(3)]
    api.add_pod(make_pod("q", "decode", "127.0.0.1", model="Qwen-Qwen2.5-0.5B-Instruct",
                         http_port=ports[0]))
    api.add_pod(make_pod("l", "prefill", "127.0.0.1", model="llama-3", http_port=ports[1]))
    api.add_pod(make_pod("x", "decode", "127.0.0.1", model="unknown", http_port=ports[2]))
    config = config_from_mapping({
        "models": [{"name": "Qwen/Qwen2.5-0.5B-Instruct"}, {"name": "llama", "discovery_label": "llama-3"}],
        "discovery": {"kubeconfig": str(api.kubeconfig), "selector": SELECTOR},
        "health": {"interval_s": 60, "timeout_s": 1}})

    async def main():
        router = Router(config)
        runner = web.AppRunner(router.app())
        await runner.setup()  # startup: the watcher starts
        try:
            def urls(model, role):
                return {w.url for w in router.groups[model].pool.by_role(role)}
            await until(lambda: urls("llama", "prefill") and urls("Qwen/Qwen2.5-0.5B-Instruct", "decode"),
                        what="both pods in their models")
            assert urls("Qwen/Qwen2.5-0.5B-Instruct", "decode") == {f"http://127.0.0.1:{ports[0]}"}
            assert urls("llama", "prefill") == {f"http://127.0.0.1:{ports[1]}"}
            assert not urls("llama", "decode") and not urls("Qwen/Qwen2.5-0.5B-Instruct", "prefill")
            assert not any(w.healthy for w in router.workers)  # nothing answers their probes
            api.delete_pod("l")
            await until(lambda: not urls("llama", "prefill"), what="the deleted pod to leave")
        finally:
            await runner.cleanup()
        assert router.discovery._task.done()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_pod_moved_through_the_admin_api_leaves_with_its_pod(api):
    """The real Router (in-process, nothing behind the pod): a discovered kv-both prefill moved to
    decode by the admin API's call (Router.move_worker) is removed when its pod is deleted, in the
    role it holds now; a later pod on the same address starts afresh (it was left in the decode
    pool, and a pod reusing the IP revived it)."""
    from aiohttp import web

    from pd_plugins.routers.config import config_from_mapping
    from pd_plugins.routers.server import Router
    from pd_plugins.testing.processes import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    api.add_pod(make_pod("w", "prefill", "127.0.0.1", http_port=port,
                         annotations={"pd-plugins.io/kv-both": "true"}))
    config = config_from_mapping({
        "discovery": {"kubeconfig": str(api.kubeconfig), "selector": SELECTOR},
        "health": {"interval_s": 60, "timeout_s": 1}})

    async def main():
        router = Router(config)
        pool = router.groups[""].pool
        runner = web.AppRunner(router.app())
        await runner.setup()  # startup: the watcher starts
        try:
            await until(lambda: pool.get(url, "prefill") is not None, what="the pod as a prefill")
            worker = pool.get(url, "prefill")
            move = await router.move_worker(url, "decode", drain_timeout_s=0)
            assert move.worker is worker and pool.get(url, "decode") is worker
            api.delete_pod("w")
            await until(lambda: pool.get(url, "decode") is None, what="the moved worker to leave")
            assert worker.removed and pool.get(url, "prefill") is None
            api.add_pod(make_pod("w2", "prefill", "127.0.0.1", http_port=port,
                                 annotations={"pd-plugins.io/kv-both": "true"}))
            await until(lambda: pool.get(url, "prefill") is not None, what="the new pod")
            assert pool.get(url, "decode") is None and pool.get(url, "prefill") is not worker
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_pods_past_max_pods_wait_and_join_when_room_frees(api):
    """Pods past max_pods are kept (at most max_pods of them) and added as held ones go, with no
    event of their own; ones past that bound too come back by a re-list once room frees."""
    for i in range(3):
        api.add_pod(make_pod(f"p{i}", "decode", f"127.0.5.{i}"))

    async def scenario(watcher, rec):
        await until(lambda: len(rec.workers) == 1 and watcher.synced.is_set(), what="max_pods")
        await until(lambda: api.count("watch") == 1, what="the first watch")
        assert len(watcher._waiting) == 1 and watcher._dropped  # one waits, one did not fit
        everyone = {f"http://127.0.5.{i}:8000" for i in range(3)}
        seen = set(rec.urls())
        for _ in range(2):  # each deletion frees the room another takes
            (held,) = rec.urls()
            api.delete_pod(f"p{held.split('.')[-1].split(':')[0]}")
            await until(lambda: len(rec.urls()) == 1 and rec.urls() != {held}, what="the next pod")
            seen |= rec.urls()
        assert seen == everyone
        assert watcher.counts["lists"] == 2  # the dropped pod came back by the one re-list

    run(api, scenario, max_pods=1)


def test_without_the_kubernetes_extra_discovery_is_a_config_error(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "lightkube", None)  # `import lightkube` now fails
    with pytest.raises(ConfigError, match=r"pip install 'pd-plugins\[kubernetes\]'"):
        plan_kubernetes(DiscoverySpec())
