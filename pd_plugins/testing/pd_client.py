"""Drive vLLM's two-step PD flow by hand (for tests and the demo; pd-router does this in service).

pull: prefill first (max_tokens=1, do_remote_decode), then decode with the returned params.
push: the decode leg goes first so it can register its blocks with the prefill while that engine
      is idle (on a busy 2-core host a prefill that finishes first can starve the handshake); both
      legs share one X-Request-Id, which is how the prefill matches the registration.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests

from pd_plugins.vocab.transfer_params import prefill_flags



@dataclass(frozen=True)
class PrefillTarget:
    url: str
    engine_id: str | None = None  # push needs it up front
    side_channel_port: int | None = None  # push needs it up front
    host: str = "127.0.0.1"
    tp_size: int = 1  # push: the decode reads the prefill's layout from it


def completion(url: str, body: dict[str, Any], request_id: str | None = None,
               timeout: float = 120.0) -> requests.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=timeout)


def prefill(target: PrefillTarget, body: dict[str, Any], request_id: str | None = None,
            timeout: float = 120.0) -> dict:
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_flags()}
    leg.pop("min_tokens", None)
    resp = completion(target.url, leg, request_id, timeout)
    resp.raise_for_status()
    return resp.json()["kv_transfer_params"]


def pd_pull(target: PrefillTarget, decode_url: str,
            body: dict[str, Any]) -> tuple[dict[str, Any], requests.Response]:
    """Both legs of a pull-mode request: (prefill's kv_transfer_params, decode response)."""
    params = prefill(target, body)
    return params, completion(decode_url, {**body, "kv_transfer_params": params})


def push_decode_params(target: PrefillTarget, request_id: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": target.engine_id,
        "remote_request_id": request_id,
        "remote_host": target.host,
        "remote_port": target.side_channel_port,
        "tp_size": target.tp_size,
    }


def pd_push(target: PrefillTarget, decode_url: str, body: dict[str, Any],
            prefill_body: dict[str, Any] | None = None, registration_head_start: float = 0.3,
            timeout: float = 120.0, prefill_first: bool = False, request_id: str | None = None,
            ) -> tuple[dict[str, Any], requests.Response]:
    """Both legs of a push-mode request: (prefill's kv_transfer_params, decode response).

    `prefill_body` lets the swap test prefill a different prompt than the decode serves.
    A push-mode prefill whose blocks no decode claims keeps its engine stepping until the lease
    expires, so callers should always run both legs. `prefill_first` sends the prefill leg
    `registration_head_start` before the decode leg instead of after it. `request_id`: both legs'
    X-Request-Id (default: a fresh one).
    """
    request_id = request_id or uuid.uuid4().hex
    decode_body = {**body, "kv_transfer_params": push_decode_params(target, request_id)}
    with ThreadPoolExecutor(1) as pool:
        if prefill_first:
            prefill_leg = pool.submit(prefill, target, prefill_body or body, request_id, timeout)
            time.sleep(registration_head_start)
            try:
                decode = completion(decode_url, decode_body, request_id, timeout)
            finally:
                params = prefill_leg.result()
            return params, decode
        decode_leg = pool.submit(completion, decode_url, decode_body, request_id, timeout)
        time.sleep(registration_head_start)
        try:
            params = prefill(target, prefill_body or body, request_id, timeout)
        finally:
            decode = decode_leg.result()  # re-raises the decode leg's own error
    return params, decode


def pd_legs(mode: str, target: PrefillTarget, decode_url: str,
            body: dict[str, Any]) -> tuple[dict[str, Any], requests.Response]:
    return (pd_pull if mode == "pull" else pd_push)(target, decode_url, body)

