"""vLLM's PD flows with NIXL (upstream connectors and PdNixlConnector).

pull: prefill leg (max_tokens=1, do_remote_decode) first; its kv_transfer_params go verbatim into the
      decode leg, which reads the KV from the prefill.
push: both legs together. The decode leg names the prefill's engine id and side channel up front and
      registers its blocks; the prefill writes into them. The decode leg goes `head_start_s` first:
      a prefill that finishes before any decode registered keeps its engine stepping and, on a
      loaded machine, starves the NIXL handshake (docs/connectors.md, "Request flow").
"""

from __future__ import annotations

import asyncio
from typing import Any

from pd_plugins.routers.config import WorkerSpec
from pd_plugins.routers.flows.base import Attempt, PdFlow, PrefillLeg, one_token_body
from pd_plugins.routers.flows.profile import EngineProfile
from pd_plugins.routers.request import LegBody
from pd_plugins.routers.upstream import WorkerFailed
from pd_plugins.vocab.engines import LOAD_METRICS, TransferMode
from pd_plugins.vocab.transfer_params import prefill_flags


def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = one_token_body(body)
    leg["kv_transfer_params"] = prefill_flags()
    return leg


class VllmPullFlow:
    sequential = True  # the decode leg goes out once the prefill leg has answered
    alongside = False

    def prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        return vllm_prefill_body(body)

    def decode_body(self, attempt: Attempt, params: Any) -> LegBody:
        """The decode leg's body: the client's, with the prefill answer's kv_transfer_params."""
        if not isinstance(params, dict) or not params.get("remote_engine_id"):
            raise WorkerFailed(attempt.decision.prefill, "prefill", "answer has no kv_transfer_params "
                               "(is the prefill started with a kv_producer connector?)")
        return attempt.request.body_with({"kv_transfer_params": params})

    async def prepare(self, attempt: Attempt, prefill_leg: PrefillLeg):
        request = attempt.request
        if attempt.decision.prefill is None:
            return request.body_with(), None
        return self.decode_body(attempt, await prefill_leg(attempt, self.prefill_body(request.body))), None


class VllmPushFlow:
    sequential = False
    alongside = True  # both legs: the decode's first, the prefill's head_start_s after it
    decode_first = True

    def __init__(self, head_start_s: float) -> None:
        self.head_start_s = head_start_s

    def bodies(self, attempt: Attempt) -> tuple[LegBody, LegBody]:
        """(the prefill leg's body, the decode leg's): the decode's names the prefill's engine and
        side channel, where the prefill will write the KV."""
        request, spec = attempt.request, attempt.decision.prefill.spec
        params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": spec.engine_id, "remote_request_id": attempt.request_id,
            "remote_host": spec.kv_host or spec.host, "remote_port": spec.kv_port,
            "tp_size": spec.tp_size,
        }
        return vllm_prefill_body(request.body), request.body_with({"kv_transfer_params": params})

    async def prepare(self, attempt: Attempt, prefill_leg: PrefillLeg):
        if attempt.decision.prefill is None:
            return attempt.request.body_with(), None
        prefill_body, decode_body = self.bodies(attempt)

        # (Any: the prefill's kv_transfer_params, None where its answer has none)
        async def delayed_prefill() -> Any:
            await asyncio.sleep(self.head_start_s)
            return await prefill_leg(attempt, prefill_body)

        return decode_body, asyncio.create_task(delayed_prefill())


def vllm_flow(transfer: TransferMode, push_head_start_s: float) -> PdFlow:
    # the pools (PdShmConnector, PdLMCacheConnector) have the pull flow's two steps: prefill,
    # then decode with its params
    return VllmPushFlow(push_head_start_s) if transfer == "push" else VllmPullFlow()


def prefill_problem(worker: WorkerSpec, transfer: TransferMode) -> str | None:
    if transfer == "push" and (worker.engine_id is None or worker.kv_port is None):
        return ("vLLM push mode needs engine_id and kv_port (the prefill's kv_transfer_config "
                "engine_id and VLLM_NIXL_SIDE_CHANNEL_PORT)")
    return None


PROFILE = EngineProfile(name="vllm", flow=vllm_flow, load_metrics=LOAD_METRICS["vllm"],
                        decode_prefills_locally=True, prefill_problem=prefill_problem)
