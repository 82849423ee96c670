"""deploy/ (docs/deploy.md): every Kustomize overlay renders with `kubectl kustomize`, every object
it renders is valid against the Kubernetes schemas (offline, strict: an unknown field fails), and
the manifests agree with our own programs: pd-router accepts the router's arguments and
configuration, vLLM's parser accepts the engines' arguments, each kv-transfer-config names a
connector we register with options it knows, and labels, annotations, ports and block sizes match
what discovery and the router expect. The security posture too: Redis's password comes from a
Secret and reaches the routers (Redis's own command run on a real redis-server), the
NetworkPolicies admit what discovery uses and nothing else, the admin token is required, and
only the router's pods mount a service-account token.

No cluster runs here: nothing is applied. kubectl (1.27 or later, for kustomize v5) comes from the
machine or .ci/run's install; without it these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml

from pd_plugins.connectors.registry import VLLM_CONNECTORS
from pd_plugins.routers.config import ModelSpec, default_discovery_label, is_label_value
from pd_plugins.routers.replica_sync import replica_sync_for
from pd_plugins.testing.kv_servers import REDIS_SERVER, RedisServer
from pd_plugins.testing.tiny_models import ensure_tiny_model
from pd_plugins.transfer import options

pytestmark = pytest.mark.processes  # spawns kubectl, pd-router --check-config and vLLM's parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# Kubernetes release whose schemas the output must satisfy: the oldest we document (native
# preStop `sleep` needs 1.30; docs/deploy.md).
K8S_VERSION = "1.31"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@functools.cache
def kubectl_problem() -> tuple[str, str | None]:
    """(path, why it cannot render deploy/ or None). Components and `labels` need kustomize v5
    (kubectl 1.27 or later); Debian 12's kubernetes-client is 1.20, with kustomize v2."""
    path = shutil.which("kubectl")
    if path is None:
        return "", ("kubectl is not installed (1.27 or later: pkgs.k8s.io's kubectl package; .ci/run "
                     "installs it)")
    done = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True,
                          text=True, timeout=60)
    try:
        kustomize = json.loads(done.stdout).get("kustomizeVersion", "")
    except json.JSONDecodeError:
        kustomize = ""
    major = re.match(r"v(\d+)", kustomize)
    if major is None or int(major.group(1)) < 5:
        return path, (f"{path}'s built-in kustomize ({kustomize or 'version unknown'}) is older "
                      "than v5: install kubectl 1.27 or later")
    return path, None


def kubectl() -> str:
    path, problem = kubectl_problem()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI cannot check deploy/: {problem}")
        pytest.skip(problem)
    return path


def render(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(DEPLOY / "overlays" / overlay))


def schema_errors(objects: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> list[str]:
    errors = []
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.absolute_path) or "(top)"
            errors.append(f"{name}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{name}: {exc.message}")
    return errors


def of_kind(objects, kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def named(objects, kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return obj


def engines(objects) -> list[dict[str, Any]]:
    return [d for d in of_kind(objects, "Deployment")
            if "pd.role" in d["spec"]["template"]["metadata"].get("labels", {})]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def expand(text: str, variables: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, `$$` escapes, others stay."""
    return re.sub(r"\$\$|" + VAR_REF.pattern,
                  lambda m: "$" if m.group(0) == "$$" else variables.get(m.group(1), m.group(0)),
                  text)


def environment(c: dict[str, Any]) -> dict[str, str]:
    """A container's variables as Kubernetes builds them: a value sees only the variables above
    it; downward-API and Secret values become placeholders."""
    variables: dict[str, str] = {}
    for entry in c.get("env", []):
        if "value" in entry:
            variables[entry["name"]] = expand(entry["value"], variables)
        else:
            source = entry["valueFrom"]
            ref = source.get("fieldRef", {}).get("fieldPath") or next(iter(source))
            variables[entry["name"]] = f"<{ref}>"
    return variables


def expanded_args(c: dict[str, Any]) -> list[str]:
    variables = environment(c)
    return [expand(arg, variables) for arg in c.get("args", [])]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ---- rendering and schemas ------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_is_valid_kubernetes(overlay: str) -> None:
    objects = rendered(overlay)
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
            "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    assert schema_errors(objects) == []
    assert not of_kind(objects, "Secret"), "secrets are created by hand, never rendered (docs/deploy.md)"


def copy_of_deploy(tmp_path: Path) -> Path:
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    return tmp_path / "deploy"


@pytest.mark.parametrize("component", ["push", "shm"])
def test_transfer_components_compose_with_the_gpu_overlay(tmp_path: Path, component: str) -> None:
    deploy = copy_of_deploy(tmp_path)
    combined = deploy / "overlays" / f"gpu-{component}"
    combined.mkdir()
    (combined / "kustomization.yaml").write_text(textwrap.dedent(f"""\
        apiVersion: kustomize.config.k8s.io/v1beta1
        kind: Kustomization
        resources: [../gpu]
        components: [../../components/{component}]
        """))
    objects = render(combined)
    assert schema_errors(objects) == []
    for engine in engines(objects):
        vllm = container(engine, "vllm")
        assert environment(vllm)["PD_KV_BUFFER_DEVICE"] == "cuda"
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert environment(container(named(objects, "Deployment", "pd-router"), "router"))[
        "PD_TRANSFER"] == component
    assert_references_resolve(objects)
    assert_connectors_match_router(objects)


@pytest.mark.parametrize("file, good, bad, expected", [
    # a misspelled field in a base manifest
    ("base/router.yaml", "readinessProbe:", "readinesProbe:", "readinesProbe"),
    # a misspelled field in a component's patch (kustomize merges it in without complaint)
    ("components/cpu/engines.yaml", "resources:", "resouces:", "resouces"),
    # a value of the wrong type
    ("base/router.yaml", "replicas: 2", "replicas: two", "two"),
])
def test_a_wrong_field_fails_validation(tmp_path: Path, file: str, good: str, bad: str,
                                        expected: str) -> None:
    deploy = copy_of_deploy(tmp_path)
    path = deploy / file
    text = path.read_text()
    assert good in text
    path.write_text(text.replace(good, bad, 1))
    errors = schema_errors(render(deploy / "overlays" / "cpu"))
    assert errors and any(expected in error for error in errors), errors


# ---- our own invariants ---------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_probes_resources_and_a_pinned_image(overlay: str) -> None:
    for deployment in of_kind(rendered(overlay), "Deployment"):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            where = f"{deployment['metadata']['name']}/{c['name']}"
            assert "readinessProbe" in c and "livenessProbe" in c, where
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert "memory" in c["resources"]["limits"], where
            assert ":" in c["image"] and not c["image"].endswith(":latest"), where
        for c in deployment["spec"]["template"]["spec"].get("initContainers", []):
            where = f"{deployment['metadata']['name']}/{c['name']} (init)"
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert "memory" in c["resources"]["limits"], where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_reference_resolves(overlay: str) -> None:
    """A $(VAR) that Kubernetes cannot resolve stays in the text, e.g. an env value naming a
    variable defined below it (strategic-merge patches move the entries they touch to the front)."""
    assert_references_resolve(rendered(overlay))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_select_something(overlay: str) -> None:
    objects = rendered(overlay)
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in of_kind(objects, "Deployment")]

    def matches(selector: dict[str, str]) -> int:
        return sum(all(labels.get(k) == v for k, v in selector.items()) for labels in pod_labels)

    for deployment in of_kind(objects, "Deployment"):
        assert matches(deployment["spec"]["selector"]["matchLabels"]) == 1, deployment["metadata"]
    for service in of_kind(objects, "Service"):
        assert matches(service["spec"]["selector"]) >= 1, service["metadata"]["name"]
    for budget in of_kind(objects, "PodDisruptionBudget"):
        assert matches(budget["spec"]["selector"]["matchLabels"]) >= 1, budget["metadata"]["name"]
    for policy in of_kind(objects, "NetworkPolicy"):
        assert matches(policy["spec"]["podSelector"]["matchLabels"]) >= 1, policy["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_discovery_labels_annotations_and_rbac(overlay: str) -> None:
    assert_discovery_matches(rendered(overlay))


def assert_discovery_matches(objects) -> None:
    router = named(objects, "Deployment", "pd-router")
    args = expanded_args(container(router, "router"))
    assert flag(args, "--discovery") == "kubernetes"
    selector = dict(pair.split("=", 1) for pair in flag(args, "--k8s-selector").split(","))
    roles = set()
    for engine in engines(objects):
        template = engine["spec"]["template"]["metadata"]
        labels, notes = template["labels"], template["annotations"]
        vllm = container(engine, "vllm")
        env, vllm_args = environment(vllm), expanded_args(vllm)
        assert all(labels.get(k) == v for k, v in selector.items()), engine["metadata"]["name"]
        roles.add(labels["pd.role"])
        # discovery's default model label (the router's own rule), a valid label value
        served = flag(vllm_args, "--served-model-name")
        assert labels["pd.model"] == default_discovery_label(served)
        assert is_label_value(labels["pd.model"])
        ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
        assert int(notes["pd-plugins.io/http-port"]) == ports["http"] == int(flag(vllm_args, "--port"))
        assert int(notes["pd-plugins.io/kv-port"]) == int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ports["nixl"]
        events = json.loads(flag(vllm_args, "--kv-events-config"))
        assert events["endpoint"].endswith(f":{notes['pd-plugins.io/kv-events-port']}")
        assert int(notes["pd-plugins.io/kv-events-port"]) == ports["kv-events"]
        # missed batches asked for again (a router started after the engine): vLLM binds it
        replay_port = notes["pd-plugins.io/kv-events-replay-port"]
        assert events["replay_endpoint"] == f"tcp://*:{replay_port}"
        assert int(replay_port) == ports["kv-replay"]
        assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == ports["http"]
    assert roles == {"prefill", "decode"}
    # with `models:`, each model's pods are those with its label; without, every engine pod
    (volume,) = [v for v in router["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    config = yaml.safe_load(named(objects, "ConfigMap", volume["configMap"]["name"])["data"]["router.yaml"])
    pod_models = {e["spec"]["template"]["metadata"]["labels"]["pd.model"] for e in engines(objects)}
    if "models" in config:
        assert {ModelSpec(name=m["name"], discovery_label=m.get("discovery_label")).pod_label
                for m in config["models"]} == pod_models
    else:
        assert len(pod_models) == 1
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert not all(router_labels.get(k) == v for k, v in selector.items()), "selector picks routers"
    assert router["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    # RBAC: the router's account may only read pods
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    (binding,) = [b for b in of_kind(objects, "RoleBinding")
                  if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"])]
    role = named(objects, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def engine_options(kv_config: dict[str, Any]) -> Any:
    """The connector's own options struct from kv_connector_extra_config; every key must be one
    of its options (a misspelled one would be ignored by the engine)."""
    cls = {"PdNixlConnector": options.NixlOptions, "PdShmConnector": options.ShmOptions,
           "PdLMCacheConnector": options.LMCacheOptions}[kv_config["kv_connector"]]
    extra = kv_config.get("kv_connector_extra_config", {})
    known = {f.name for f in options.fields(cls)}
    assert set(extra) <= known, f"unknown options {set(extra) - known}"
    return options.from_extra_config(cls, lambda key, default: extra.get(key, default), "test")


def assert_connectors_match_router(objects) -> None:
    transfer = flag(expanded_args(container(named(objects, "Deployment", "pd-router"), "router")),
                    "--transfer")
    for engine in engines(objects):
        role = engine["spec"]["template"]["metadata"]["labels"]["pd.role"]
        kv_config = json.loads(flag(expanded_args(container(engine, "vllm")), "--kv-transfer-config"))
        assert kv_config["kv_connector"] in {spec.name for spec in VLLM_CONNECTORS}
        assert kv_config["kv_role"] == ROLES[role]
        opts = engine_options(kv_config)
        if transfer in ("pull", "push"):
            assert kv_config["kv_connector"] == "PdNixlConnector" and opts.mode == transfer
        else:
            assert transfer == "shm" and kv_config["kv_connector"] == "PdShmConnector"
        if transfer == "push" and role == "prefill":
            # the router names it in the decode leg; discovery takes it from the pod's name
            assert kv_config["engine_id"] == "<metadata.name>"


def assert_references_resolve(objects) -> None:
    for deployment in of_kind(objects, "Deployment"):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            where = f"{deployment['metadata']['name']}/{c['name']}"
            left = [ref for text in [*environment(c).values(), *expanded_args(c)]
                    for ref in VAR_REF.findall(text)]
            assert left == [], f"{where}: unresolved $(...) references {left}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_name_our_connectors_consistently_with_the_router(overlay: str) -> None:
    assert_connectors_match_router(rendered(overlay))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_refuse_kv_fault_injection(overlay: str) -> None:
    """Every engine runs with PD_PRODUCTION=1 (transfer/kv_faults.py refuses faults under it) and
    no overlay asks for faults: a copied test setting can never damage a deployment's KV."""
    for deployment in engines(rendered(overlay)):
        env = environment(container(deployment, "vllm"))
        where = deployment["metadata"]["name"]
        assert env.get("PD_PRODUCTION") == "1", where
        assert "PD_KV_FAULTS" not in env and "PD_KV_FAULTS_ALLOWED" not in env, where
        assert "faults" not in json.loads(env["PD_KV_EXTRA_CONFIG"]), where


# What the Secret pd-redis-auth holds in these tests: characters a URL would have to encode.
TEST_REDIS_PASSWORD = "p@ss:w/rd%?#"
# the Secrets' variables of the router container, as these tests fill them
ROUTER_CHECK_ENV = {"PD_ROUTER_ADMIN_TOKEN": "test-admin-token", "PD_ROUTER_API_KEYS": "test-key",
                    "PD_ROUTER_REDIS_PASSWORD": TEST_REDIS_PASSWORD}
REDIS_SECRET = {"name": "pd-redis-auth", "key": "password"}


def mounts(c: dict[str, Any]) -> dict[str, str]:
    """mountPath -> volume name."""
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def pod_volume(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return found


def secret_refs(c: dict[str, Any]) -> dict[str, dict[str, str]]:
    """A container's variables that come from a Secret: name -> {name, key}."""
    return {e["name"]: {k: e["valueFrom"]["secretKeyRef"][k] for k in ("name", "key")}
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


def router_config_map(objects) -> dict[str, Any]:
    """The router's router.yaml as its ConfigMap has it (the one ConfigMap its pod mounts)."""
    router = named(objects, "Deployment", "pd-router")
    (mounted,) = [v for v in router["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    return yaml.safe_load(
        named(objects, "ConfigMap", mounted["configMap"]["name"])["data"]["router.yaml"])


def router_config_file(objects, tmp_path: Path) -> Path:
    """router.yaml as the router container reads it (its ConfigMap, mounted at --config's
    directory), with this machine's model paths."""
    router = named(objects, "Deployment", "pd-router")
    config_path = Path(flag(expanded_args(container(router, "router")), "--config"))
    volume = pod_volume(router, mounts(container(router, "router"))[str(config_path.parent)])
    text = named(objects, "ConfigMap", volume["configMap"]["name"])["data"][config_path.name]
    out = tmp_path / "router.yaml"
    out.write_text(local_paths(text))
    return out


def router_check(objects, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The router container's command through `pd-router --check-config`, with its
    configuration file and the Secrets' variables (ROUTER_CHECK_ENV, over which `env`)."""
    c = container(named(objects, "Deployment", "pd-router"), "router")
    assert c["command"] == ["pd-router"]
    assert set(secret_refs(c)) == set(ROUTER_CHECK_ENV)
    args = [local_paths(arg) for arg in expanded_args(c)]
    args[args.index("--config") + 1] = str(router_config_file(objects, tmp_path))
    return subprocess.run([sys.executable, "-m", "pd_plugins.routers", *args, "--check-config"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, **ROUTER_CHECK_ENV, **env,
                               "KUBECONFIG": str(kubeconfig_to_nowhere(tmp_path))})


def kubeconfig_to_nowhere(tmp_path: Path) -> Path:
    """A kubeconfig that points nowhere: checking the configuration must not need a cluster."""
    path = tmp_path / "kubeconfig"
    path.write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: Config
        clusters: [{name: none, cluster: {server: "https://127.0.0.1:9"}}]
        users: [{name: none, user: {token: none}}]
        contexts: [{name: none, context: {cluster: none, user: none, namespace: pd-plugins}}]
        current-context: none
        """))
    return path


def local_paths(text: str) -> str:
    """The pods' model paths as this machine has them: the cpu image's /models/<tiny model> is
    the locally built model; the gpu overlay's /tokenizer/tokenizer.json (Qwen's, fetched when
    the pod starts) gets tiny-llama's as a stand-in, since only its loading is checked here."""
    text = re.sub(r"/models/([a-z0-9-]+)", lambda m: str(ensure_tiny_model(m.group(1))), text)
    return text.replace("/tokenizer/tokenizer.json", str(ensure_tiny_model("tiny-llama")))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pd_router_accepts_the_arguments_and_configuration(overlay: str, tmp_path: Path) -> None:
    """The router's container command, with router.yaml as its pod mounts it and the Secrets'
    variables, through `--check-config`."""
    done = router_check(rendered(overlay), tmp_path)
    assert done.returncode == 0, f"pd-router:\n{done.stderr}{done.stdout}"
    assert "configuration OK" in done.stdout


# vLLM's own `serve` parser (as `pd-vllm serve` builds it) over every engine's arguments, in one
# process (importing vLLM takes a while): unknown flags, bad values and a bad --config file fail.
VLLM_PARSE = """
import json, sys
from pd_plugins.launcher import install_version_shim
install_version_shim()
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
results = []
for args in json.load(open(sys.argv[1])):
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))
    try:
        parsed = parser.parse_args(args)
        validate_parsed_serve_args(parsed)
        results.append({"block_size": parsed.block_size,
                        "kv_connector": parsed.kv_transfer_config.kv_connector})
    except (Exception, SystemExit) as exc:
        results.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(results))
"""


def test_vllm_accepts_every_engines_arguments(tmp_path: Path) -> None:
    cases, argv = [], []
    for overlay in OVERLAYS:
        objects = rendered(overlay)
        router_args = expanded_args(container(named(objects, "Deployment", "pd-router"), "router"))
        for engine in engines(objects):
            vllm = container(engine, "vllm")
            assert vllm["command"] == ["pd-vllm"]
            args = expanded_args(vllm)
            assert args[0] == "serve"
            (volume,) = [v for v in engine["spec"]["template"]["spec"]["volumes"]
                         if v["name"] == "engine-args"]
            file = tmp_path / f"{overlay}-{engine['metadata']['name']}.yaml"
            file.write_text(named(objects, "ConfigMap", volume["configMap"]["name"])["data"]["vllm.yaml"])
            args[args.index("--config") + 1] = str(file)
            argv.append(["--model", args[1], *args[2:]])
            cases.append((overlay, engine["metadata"]["name"], int(flag(router_args, "--block-size"))))
    (tmp_path / "argv.json").write_text(json.dumps(argv))
    done = subprocess.run([sys.executable, "-c", VLLM_PARSE, str(tmp_path / "argv.json")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (overlay, name, router_block_size), result in zip(cases, results, strict=True):
        assert "error" not in result, f"{overlay} {name}: {result['error']}"
        # the router's prefix index keys blocks as the engines do
        assert result["block_size"] == router_block_size, f"{overlay} {name}"


# ---- Redis: a password from a Secret, which the routers get too -----------------------------

def router_config(objects, tmp_path: Path, monkeypatch) -> Any:
    """The RouterConfig the router container builds: its arguments, router.yaml as its pod mounts
    it and the Secrets' variables (ROUTER_CHECK_ENV)."""
    from pd_plugins.routers.cli import build_parser, config_from_args

    c = container(named(objects, "Deployment", "pd-router"), "router")
    args = [local_paths(arg) for arg in expanded_args(c)]
    args[args.index("--config") + 1] = str(router_config_file(objects, tmp_path))
    for name, value in ROUTER_CHECK_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig_to_nowhere(tmp_path)))
    return config_from_args(build_parser().parse_args(args))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_requires_the_password_the_routers_are_given(overlay: str, tmp_path: Path,
                                                           monkeypatch) -> None:
    """Redis starts with requirepass from the Secret pd-redis-auth (never from the manifests),
    its probe authenticates, and the router container gets the same key as
    PD_ROUTER_REDIS_PASSWORD, which its configuration takes; the ConfigMap holds none."""
    objects = rendered(overlay)
    redis = container(named(objects, "Deployment", "pd-redis"), "redis")
    assert secret_refs(redis) == {"REDISCLI_AUTH": REDIS_SECRET}
    assert "--requirepass \"$REDISCLI_AUTH\"" in " ".join(redis["command"] + redis["args"])
    router = container(named(objects, "Deployment", "pd-router"), "router")
    assert secret_refs(router)["PD_ROUTER_REDIS_PASSWORD"] == REDIS_SECRET
    text = router_config_file(objects, tmp_path).read_text()
    sessions = yaml.safe_load(text)["sessions"]
    assert urllib.parse.urlsplit(sessions["redis_url"]).password is None
    assert "redis_password" not in sessions and TEST_REDIS_PASSWORD not in text
    config = router_config(objects, tmp_path, monkeypatch)
    assert config.sessions.redis_password == TEST_REDIS_PASSWORD
    assert (urllib.parse.urlsplit(config.sessions.redis_url).hostname
            == named(objects, "Service", "pd-redis")["metadata"]["name"])


def test_an_empty_redis_password_stops_redis_and_the_routers(tmp_path: Path) -> None:
    """requirepass "" would be no password at all: both pods refuse to start with one."""
    objects = rendered("cpu")
    redis = container(named(objects, "Deployment", "pd-redis"), "redis")
    done = subprocess.run([*redis["command"], *redis["args"]], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "REDISCLI_AUTH": ""})
    assert done.returncode != 0 and "empty password" in done.stderr
    done = router_check(objects, tmp_path, PD_ROUTER_REDIS_PASSWORD="")
    assert done.returncode != 0 and "redis_password" in done.stderr, done.stderr


@dataclass
class ManifestRedis(RedisServer):
    """The pd-redis container's own command, on a loopback port (a `redis-server` on PATH that
    adds --port and --bind after the manifest's arguments: the last one wins)."""

    name: str = "manifest-redis"
    argv: list[str] = field(default_factory=list)
    password: str = ""

    def command(self) -> list[str]:
        shim = self.log_dir / "bin" / "redis-server"
        shim.parent.mkdir(exist_ok=True)
        shim.write_text(f'#!/bin/sh\nexec {REDIS_SERVER} "$@" --port {self.port} '
                        f'--bind 127.0.0.1 --dir {self.log_dir}\n')
        shim.chmod(0o755)
        return self.argv

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self.log_dir / 'bin'}:{os.environ['PATH']}",
                "REDISCLI_AUTH": self.password}

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False


def test_redis_as_deployed_takes_the_routers_password_and_no_other(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """The Redis container's command run on a real redis-server, its readiness probe, and the
    router's own Redis client configured as the router container is."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis_py = pytest.importorskip("redis")
    objects = rendered("cpu")
    deployment = named(objects, "Deployment", "pd-redis")
    redis = container(deployment, "redis")
    server = ManifestRedis(argv=[*redis["command"], *redis["args"]], password=TEST_REDIS_PASSWORD)
    try:
        server.start().wait_healthy()
        # the readiness probe, with the container's environment
        probe = redis["readinessProbe"]["exec"]["command"]
        assert probe[0] == "redis-cli"
        for password, answer in ((TEST_REDIS_PASSWORD, "PONG"), ("", "NOAUTH")):
            done = subprocess.run([probe[0], "-p", str(server.port), *probe[1:]], capture_output=True,
                                  text=True, timeout=30, env={**os.environ, "REDISCLI_AUTH": password})
            assert answer in done.stdout + done.stderr, (password, done)
        # the router's own Redis client (replica_sync), configured as its container is, its
        # URL pointed at this server
        sessions = router_config(objects, tmp_path, monkeypatch).sessions
        local = urllib.parse.urlunsplit(urllib.parse.urlsplit(sessions.redis_url)._replace(
            netloc=f"127.0.0.1:{server.port}"))
        sync = replica_sync_for(msgspec.structs.replace(sessions, redis_url=local))

        async def append() -> None:
            try:
                await sync.log.append(b"x")
            finally:
                await sync.log.aclose()
        asyncio.run(append())
        with redis_py.Redis(host="127.0.0.1", port=server.port, socket_timeout=5) as client:
            with pytest.raises(redis_py.exceptions.AuthenticationError):
                client.ping()
        # redis-server's process title hides the password that is in its arguments
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline")
        if cmdline.exists():
            assert TEST_REDIS_PASSWORD.encode() not in cmdline.read_bytes()
    finally:
        server.stop(grace=5)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_pods_that_call_the_api_mount_a_token(overlay: str) -> None:
    """A service-account token is mounted only where the account is bound to a Role (the
    router's, for discovery); engines and Redis never call the Kubernetes API."""
    objects = rendered(overlay)
    bound = {s["name"] for b in of_kind(objects, "RoleBinding") for s in b["subjects"]
             if s["kind"] == "ServiceAccount"}
    assert "default" not in bound
    for deployment in of_kind(objects, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        account = spec.get("serviceAccountName", "default")
        where = deployment["metadata"]["name"]
        if account in bound:
            assert spec.get("automountServiceAccountToken", True) is True, where
        else:
            assert spec.get("automountServiceAccountToken") is False, where
    # discovery needs the token: the router's account is the bound one, and it does not refuse
    # tokens either (a pod's own setting would override the account's, but keep them agreeing)
    router = named(objects, "Deployment", "pd-router")["spec"]["template"]["spec"]
    assert router["serviceAccountName"] in bound
    account = named(objects, "ServiceAccount", router["serviceAccountName"])
    assert account.get("automountServiceAccountToken", True) is True


# ---- NetworkPolicies: who reaches which port --------------------------------------------------

NAMESPACE = "pd-plugins"


def pod_ports(deployment: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"]
            for c in deployment["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
            if "name" in p}


def all_ports(deployment: dict[str, Any]) -> set[int]:
    return {p["containerPort"]
            for c in deployment["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """matchLabels only (what these manifests use; an expression would fail here, not pass)."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admitted(objects, target: dict[str, Any], source_labels: dict[str, str],
             source_namespace: str = NAMESPACE,
             namespace_labels: dict[str, str] | None = None) -> set[int]:
    """The target Deployment's pod ports that a pod with these labels, in that namespace (with
    those namespace labels), may open, as NetworkPolicy decides: no policy selecting the pod admits
    everything; else the union of the rules that match the source, a named port being the
    target's container port of that name."""
    labels = target["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in of_kind(objects, "NetworkPolicy") if selects(p["spec"]["podSelector"], labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return all_ports(target)
    names = pod_ports(target)
    ns_labels = {"kubernetes.io/metadata.name": source_namespace, **(namespace_labels or {})}
    ports: set[int] = set()
    for policy in policies:
        assert policy["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        for rule in policy["spec"].get("ingress", []):
            def peer_matches(peer: dict[str, Any]) -> bool:
                if "ipBlock" in peer:
                    return False
                if "namespaceSelector" in peer and not selects(peer["namespaceSelector"], ns_labels):
                    return False
                if "namespaceSelector" not in peer and source_namespace != NAMESPACE:
                    return False
                return "podSelector" not in peer or selects(peer["podSelector"], source_labels)
            if "from" in rule and not any(peer_matches(peer) for peer in rule["from"]):
                continue
            if "ports" not in rule:
                return all_ports(target)
            for port in rule["ports"]:
                assert port.get("protocol", "TCP") == "TCP" and "endPort" not in port, port
                number = names.get(port["port"]) if isinstance(port["port"], str) else port["port"]
                if number is not None:
                    ports.add(number)
    return ports


def assert_network_policies(objects) -> None:
    router = named(objects, "Deployment", "pd-router")
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    redis = named(objects, "Deployment", "pd-redis")
    stranger = {"app.kubernetes.io/name": "something-else"}
    prometheus = {"pd-plugins.io/scrape-engines": "true"}
    clients = {"pd-plugins.io/router-clients": "true"}
    for engine in engines(objects):
        name = engine["metadata"]["name"]
        notes = engine["spec"]["template"]["metadata"]["annotations"]
        # what discovery makes the router open: the annotations' ports
        used = {int(notes[f"pd-plugins.io/{key}"])
                for key in ("http-port", "kv-events-port", "kv-events-replay-port")}
        assert used <= admitted(objects, engine, router_labels), name
        assert admitted(objects, engine, router_labels) == used, name
        for other in engines(objects):  # NIXL, UCX and lease checks: any port between engines
            assert admitted(objects, engine, other["spec"]["template"]["metadata"]["labels"]) == \
                all_ports(engine), name
        assert admitted(objects, engine, stranger) == set(), name
        scraped = {int(notes["prometheus.io/port"])}
        assert admitted(objects, engine, {}, "monitoring", prometheus) == scraped, name
        assert admitted(objects, engine, router_labels, "elsewhere") == set(), name
    # Redis: the port of the routers' redis_url, from the routers only
    redis_port = urllib.parse.urlsplit(router_config_map(objects)["sessions"]["redis_url"]).port or 6379
    assert admitted(objects, redis, router_labels) == {redis_port}
    assert admitted(objects, redis, stranger) == set()
    assert admitted(objects, redis, {}, "elsewhere", clients) == set()
    # the routers: their Service's port, from this namespace and labelled namespaces only
    (service_port,) = named(objects, "Service", "pd-router")["spec"]["ports"]
    http = pod_ports(router)[service_port["targetPort"]]
    assert admitted(objects, router, stranger) == {http}
    assert admitted(objects, router, {}, "elsewhere", clients) == {http}
    assert admitted(objects, router, {}, "monitoring", prometheus) == {http}
    assert admitted(objects, router, {}, "elsewhere") == set()
    assert admitted(objects, router, router_labels, "elsewhere") == set()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_what_discovery_uses_and_nothing_else(overlay: str) -> None:
    assert_network_policies(rendered(overlay))


def test_moved_engine_ports_stay_reachable(tmp_path: Path) -> None:
    """Change an engine's HTTP, KV-events and replay ports everywhere engines.yaml names them
    (the annotations discovery reads, the container ports, vLLM's arguments): the router may
    still open them all (the policies name the container ports, not numbers)."""
    deploy = copy_of_deploy(tmp_path)
    path = deploy / "base" / "engines" / "engines.yaml"
    text = path.read_text()
    assert text.count('"8000"') >= 4 and text.count("5557") >= 3 and text.count("5558") >= 3
    path.write_text(text.replace('"8000"', '"8100"')
                    .replace("containerPort: 8000", "containerPort: 8100")
                    .replace("5557", "5567").replace("5558", "5568"))
    objects = render(deploy / "overlays" / "cpu")
    assert_discovery_matches(objects)
    for engine in engines(objects):
        notes = engine["spec"]["template"]["metadata"]["annotations"]
        assert notes["pd-plugins.io/http-port"] == "8100"
        assert notes["pd-plugins.io/kv-events-port"] == "5567"
        assert notes["pd-plugins.io/kv-events-replay-port"] == "5568"
    assert_network_policies(objects)


# ---- the admin API ---------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_admin_api_needs_a_token_from_a_secret(overlay: str) -> None:
    """/admin shares the routers' port with the API: the token is always set, from the Secret
    (the Secret and its key are required: no optional), never in the ConfigMap."""
    objects = rendered(overlay)
    router = named(objects, "Deployment", "pd-router")
    c = container(router, "router")
    (entry,) = [e for e in c["env"] if e["name"] == "PD_ROUTER_ADMIN_TOKEN"]
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "pd-router-secrets", "key": "admin-token"}
    assert "--admin-token" not in c["args"]
    for config_map in of_kind(objects, "ConfigMap"):
        for text in config_map["data"].values():
            assert "admin_token" not in text, config_map["metadata"]["name"]


def test_an_empty_admin_token_stops_the_router(tmp_path: Path) -> None:
    """An empty admin-token key: pd-router refuses to start, it never serves /admin open."""
    done = router_check(rendered("cpu"), tmp_path, PD_ROUTER_ADMIN_TOKEN="")
    assert done.returncode != 0 and "admin_token" in done.stderr, done.stderr
