"""`pd-router` (also `python -m pd_plugins.routers`): flags for the common case, YAML for the rest.

    pd-router --engine vllm --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    pd-router --config router.yaml --port 8000        # flags override the file

Worker flags take options after the URL: `--prefill URL engine_id=p0 kv_port=5600` (vLLM push) or
`--prefill URL 8998` (SGLang bootstrap port, as sglang-router spells it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import msgspec

from pd_plugins.routers.config import ConfigError, RouterConfig, config_from_mapping, load_yaml, parse_worker_arg
from pd_plugins.routers.policy import DEFAULT_POLICY, PRESETS, preset
from pd_plugins.vocab.engines import ENGINES, TRANSFER_MODES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-router", description="Prefill/decode disaggregation router "
                                "(OpenAI-compatible) for vLLM and SGLang")
    p.add_argument("--config", help="YAML file with the full configuration (see docs/router.md)")
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("--mode", choices=["gateway", "sidecar"],
                   help="gateway: choose prefill and decode; sidecar: beside one decode server")
    p.add_argument("--transfer", choices=TRANSFER_MODES,
                   help="vLLM workers' KV transfer: NIXL pull or push, or a shared pool "
                        "(shm, lmcache)")
    p.add_argument("--prefill", action="append", nargs="+", metavar="URL",
                   help="a prefill worker: URL [KEY=VALUE ...] (repeat the flag for more)")
    p.add_argument("--decode", action="append", nargs="+", metavar="URL",
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
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["json", "text"], default="json")
    p.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    source = args.config or "flags"
    for key in ("engine", "mode", "transfer", "host", "port", "tokenizer", "block_size",
                "client_transfer_fields", "route_header", "tls_cert", "tls_key", "api_key_file",
                "log_level"):
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    for role in ("prefill", "decode"):
        if getattr(args, role):
            data[role] = [parse_worker_arg(values) for values in getattr(args, role)]
    policy = args.policy or data.get("policy", DEFAULT_POLICY)
    if isinstance(policy, str):
        data["policy"] = msgspec.to_builtins(preset(policy))
    data.setdefault("admin_token", args.admin_token or os.environ.get("PD_ROUTER_ADMIN_TOKEN"))
    if args.admin_token:
        data["admin_token"] = args.admin_token
    env_keys = [k.strip() for k in os.environ.get("PD_ROUTER_API_KEYS", "").split(",") if k.strip()]
    if env_keys:
        data["api_keys"] = [*(data.get("api_keys") or []), *env_keys]
    config = config_from_mapping(data, source)
    from pd_plugins.routers.server import Router
    Router(config)  # builds every policy piece: unknown names and bad params fail here
    return config


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
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        sys.exit(f"pd-router: {exc}")
    if args.check_config:
        print(f"pd-router: configuration OK ({len(config.prefill)} prefill, {len(config.decode)} decode)")
        return
    setup_logging(config.log_level, args.log_format)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        logging.getLogger("pd_router").info("uvloop not installed; using asyncio's event loop")
    from aiohttp import web

    from pd_plugins.routers.server import Router
    router = Router(config)
    # handler_cancellation: a client that disconnects cancels its handler, which closes both
    # legs, so the engines abort the request and free its KV (aiohttp's default is off).
    web.run_app(router.app(), host=config.host, port=config.port, access_log=None,
                print=None, handle_signals=True, handler_cancellation=True, ssl_context=router.tls)


if __name__ == "__main__":
    main()
