"""SGLang's PD flow: the same body to prefill and decode, tied together by bootstrap fields.

The decode engine asks the prefill's bootstrap server (bootstrap_host:bootstrap_port) for room
`bootstrap_room`; the prefill engine runs it on DP rank `room % dp_size`. Rooms are drawn so that
one conversation (x-session-id) always lands on the same prefill DP rank, where its prefix is cached.
"""

from __future__ import annotations

import asyncio
import random
import zlib

from pd_plugins.routers.config import WorkerSpec
from pd_plugins.routers.flows.base import Attempt, PdFlow, PrefillLeg
from pd_plugins.routers.flows.profile import EngineProfile
from pd_plugins.routers.request import LegBody
from pd_plugins.vocab.engines import LOAD_METRICS, TransferMode

ROOM_BITS = 63


def bootstrap_room(dp_size: int, session_id: str | None, rng: random.Random = random._inst) -> int:
    room = rng.getrandbits(ROOM_BITS)
    if dp_size <= 1 or session_id is None:
        return room
    rank = zlib.crc32(session_id.encode()) % dp_size
    room -= room % dp_size - rank
    return room if room >= 0 else room + dp_size


class SglangFlow:
    sequential = False
    alongside = True  # the decode asks the prefill's bootstrap server for the KV: both legs at once
    decode_first = False
    head_start_s = 0.0

    async def prepare(self, attempt: Attempt, prefill_leg: PrefillLeg):
        if attempt.decision.prefill is None:
            return attempt.request.body_with(), None
        prefill_body, tied = self.bodies(attempt)
        return tied, asyncio.create_task(prefill_leg(attempt, prefill_body))

    def bodies(self, attempt: Attempt) -> tuple[LegBody, LegBody]:
        """(the prefill leg's body, the decode leg's): the client's, tied by a bootstrap room, and
        the prefill's not streamed (its answer is read whole)."""
        request, spec = attempt.request, attempt.decision.prefill.spec
        room = {"bootstrap_host": spec.host, "bootstrap_port": spec.bootstrap_port,
                "bootstrap_room": bootstrap_room(spec.dp_size, request.info.session_id)}
        tied = request.body_with(room)
        stream = request.body.get("stream")
        if stream is False:  # (the client's own "stream": false)
            return tied, tied
        if stream is None:
            return request.body_with({**room, "stream": False}), tied
        return {**request.body, **room, "stream": False}, tied


def sglang_flow(transfer: TransferMode, push_head_start_s: float) -> PdFlow:
    return SglangFlow()  # the engines move the KV themselves, whatever the transport


def prefill_problem(worker: WorkerSpec, transfer: TransferMode) -> str | None:
    return "SGLang needs bootstrap_port" if worker.bootstrap_port is None else None


PROFILE = EngineProfile(
    name="sglang", flow=sglang_flow, load_metrics=LOAD_METRICS["sglang"],
    # a decode in disaggregation mode cannot prefill: deciders are skipped, and no usable prefill
    # worker is a 503
    decode_prefills_locally=False, prefill_problem=prefill_problem,
    canary_path="/health_generate")  # SGLang's own check that its scheduler still generates
