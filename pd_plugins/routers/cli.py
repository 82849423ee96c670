"""`pd-router` (also `python -m pd_plugins.routers`): flags for the common case, YAML for the rest.

    pd-router --engine vllm --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    pd-router --config router.yaml --port 8000        # flags override the file

Worker flags take options after the URL: `--prefill URL engine_id=p0 kv_port=5600` (vLLM push) or
`--prefill URL 8998` (SGLang bootstrap port, as sglang-router spells it).

Several models: `--model NAME [KEY=VALUE ...]` starts a model, and the --prefill/--decode flags
after it (up to the next --model) are its workers:

    pd-router --model Qwen/Qwen2.5-0.5B-Instruct --prefill http://p0:8000 --decode http://d0:8000 \
              --model meta-llama/Llama-3.2-1B policy=least_loaded --decode http://d1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Any, get_args

import msgspec

from pd_plugins.routers import native
from pd_plugins.routers.config import (
    ConfigError, LogLevel, RouterConfig, config_from_mapping, load_yaml, parse_model_arg,
    parse_worker_arg,
)
from pd_plugins.vocab.engines import ENGINES, TRANSFER_MODES


class _InOrder(argparse.Action):
    """An appending flag that also records its place among --model/--prefill/--decode, so that a
    worker flag belongs to the --model before it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), values])
        namespace.worker_flags = [*namespace.worker_flags, (self.dest, values)]


def build_parser() -> argparse.ArgumentParser:
    # (the policy's modules are imported here, not with this module: main() must load the
    # router's compiled modules, some of them the policy's, before they are first imported)
    from pd_plugins.routers.policy import DEFAULT_POLICY, PRESETS
    p = argparse.ArgumentParser(prog="pd-router", description="Prefill/decode disaggregation router "
                                "(OpenAI-compatible) for vLLM and SGLang")
    p.add_argument("--config", help="YAML file with the full configuration (see docs/router.md)")
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("--mode", choices=["gateway", "sidecar"],
                   help="gateway: choose prefill and decode; sidecar: beside one decode server")
    p.add_argument("--transfer", choices=TRANSFER_MODES,
                   help="vLLM workers' KV transfer: NIXL pull or push, or a shared pool "
                        "(shm, lmcache)")
    p.set_defaults(worker_flags=[])
    p.add_argument("--model", action=_InOrder, nargs="+", metavar="NAME",
                   help="start a model: NAME [policy=PRESET transfer=MODE block_size=N "
                        "tokenizer=PATH discovery_label=LABEL]; the --prefill/--decode flags after "
                        "it are its workers (repeat for more models; replaces `models:` of --config)")
    p.add_argument("--prefill", action=_InOrder, nargs="+", metavar="URL",
                   help="a prefill worker: URL [KEY=VALUE ...] (repeat the flag for more)")
    p.add_argument("--decode", action=_InOrder, nargs="+", metavar="URL",
                   help="a decode worker: URL [KEY=VALUE ...] (repeat the flag for more)")
    p.add_argument("--policy", help=f"a named policy stack: {', '.join(PRESETS)} "
                                    f"(default {DEFAULT_POLICY})")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--tokenizer", help="local tokenizer (model dir or tokenizer.json) for text prompts")
    p.add_argument("--block-size", type=int, help="token block size of the prefix index")
    p.add_argument("--admin-token", help="bearer token of the admin API (or PD_ROUTER_ADMIN_TOKEN)")
    p.add_argument("--client-transfer-fields", choices=["reject", "strip"])
    p.add_argument("--route-header", choices=["minimal", "full"],
                   help="x-pd-route: the decision only (default), or with worker URLs, scores "
                        "and session ids")
    p.add_argument("--tls-cert", help="PEM certificate (chain) for HTTPS on the router's listener")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--api-key-file", help="client API keys, one per line: /v1/* then need "
                                          "'Authorization: Bearer KEY' (also PD_ROUTER_API_KEYS, "
                                          "comma-separated)")
    p.add_argument("--discovery", choices=["kubernetes"],
                   help="find workers while serving: kubernetes (pods by label; docs/router.md)")
    p.add_argument("--k8s-namespace", help="namespace of the engine pods (default: the router "
                                           "pod's own in a cluster, else the kubeconfig's)")
    p.add_argument("--k8s-selector", help="label selector of the engine pods "
                                          "(default app.kubernetes.io/part-of=pd-plugins)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service "
                                        "account, else $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--traffic-record", metavar="PATH",
                   help="write what the router routes to PATH, one JSON line per request (no prompt "
                        "text; rotated; the YAML's traffic_record sets the limits)")
    p.add_argument("--log-level", choices=get_args(LogLevel))
    p.add_argument("--log-format", choices=["json", "text"], default="json")
    p.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    return p


class _Merged(msgspec.Struct):
    """The YAML values that flags and PD_ROUTER_API_KEYS are merged into, checked before they are
    (a string `api_keys` would be spread into one-character keys, each one valid; the others
    failed with a traceback)."""

    api_keys: list[str] = []
    models: list[Any] = []
    traffic_record: dict[str, Any] | None = None
    discovery: dict[str, Any] | None = None


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    source = args.config or "flags"
    try:
        msgspec.convert(data, _Merged)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    for key in ("engine", "mode", "transfer", "host", "port", "tokenizer", "block_size",
                "client_transfer_fields", "route_header", "tls_cert", "tls_key", "api_key_file",
                "log_level"):
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    if args.model:
        data["models"] = models_from_flags(args.worker_flags)
    else:
        for role in ("prefill", "decode"):
            if getattr(args, role):
                data[role] = [parse_worker_arg(values) for values in getattr(args, role)]
    if args.traffic_record:
        data["traffic_record"] = {**(data.get("traffic_record") or {}), "path": args.traffic_record}
    discovery = {key: value for key, value in (("kind", args.discovery), ("namespace", args.k8s_namespace),
                 ("selector", args.k8s_selector), ("kubeconfig", args.kubeconfig)) if value is not None}
    if discovery:
        if not args.discovery and not data.get("discovery"):
            raise ConfigError("--k8s-namespace, --k8s-selector and --kubeconfig need "
                              "--discovery kubernetes (or `discovery:` in the YAML)")
        data["discovery"] = {**(data.get("discovery") or {}), **discovery}
    from pd_plugins.routers.policy import DEFAULT_POLICY, preset  # (as in build_parser)
    policy = args.policy or data.get("policy", DEFAULT_POLICY)
    if isinstance(policy, str):
        data["policy"] = msgspec.to_builtins(preset(policy))
    for model in data.get("models") or []:  # a model's policy may name a preset too
        if isinstance(model, dict) and isinstance(model.get("policy"), str):
            model["policy"] = msgspec.to_builtins(preset(model["policy"]))
    data.setdefault("admin_token", args.admin_token or os.environ.get("PD_ROUTER_ADMIN_TOKEN"))
    if args.admin_token:
        data["admin_token"] = args.admin_token
    redis_password = os.environ.get("PD_ROUTER_REDIS_PASSWORD")
    if redis_password is not None:  # from a Secret; the YAML's own value, if any, wins
        sessions = data.get("sessions")
        data["sessions"] = sessions = dict(sessions) if isinstance(sessions, dict) else {}
        sessions.setdefault("redis_password", redis_password)
    env_keys = [k.strip() for k in os.environ.get("PD_ROUTER_API_KEYS", "").split(",") if k.strip()]
    if env_keys:
        data["api_keys"] = [*(data.get("api_keys") or []), *env_keys]
    config = config_from_mapping(data, source)
    from pd_plugins.routers.server import Router
    Router(config)  # builds every policy piece: unknown names and bad params fail here
    return config


def models_from_flags(flags: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
    """--model, --prefill and --decode in the order given: each worker joins the model before it."""
    models: list[dict[str, Any]] = []
    for dest, values in flags:
        if dest == "model":
            models.append(parse_model_arg(values))
        elif not models:
            raise ConfigError(f"--{dest} {values[0]} comes before the first --model: with --model, "
                              "each --prefill/--decode follows the model it serves")
        else:
            models[-1].setdefault(dest, []).append(parse_worker_arg(values))
    return models


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (and exc when there is one)."""

    _encode = msgspec.json.Encoder().encode

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return self._encode(entry).decode()


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.Formatter.converter = time.gmtime


def main(argv: list[str] | None = None) -> None:
    # first: the hot path's modules come from its build, if there is one (config_from_args
    # imports the policy package, and builds a Router, which import the rest)
    hot_path = native.activate()
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        sys.exit(f"pd-router: {exc}")
    if args.check_config:
        print("pd-router: configuration OK (" + "; ".join(
            f"{m.name + ': ' if m.name else ''}{len(m.prefill)} prefill, {len(m.decode)} decode"
            for m in config.model_groups()) + ")")
        return
    setup_logging(config.log_level, args.log_format)
    log = logging.getLogger("pd_router")
    (log.info if native.native() else log.warning)("hot path: %s", hot_path)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        logging.getLogger("pd_router").info("uvloop not installed; using asyncio's event loop")
    from pd_plugins.routers.server import Router
    router = Router(config)
    asyncio.run(router.serve())


if __name__ == "__main__":
    main()
