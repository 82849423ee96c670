"""Injected failures: what a broken engine does to the router (`--fail-rate` and the like, or
`POST /mock/faults` at run time)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict, dataclass
from typing import Awaitable

import msgspec
from aiohttp import web

from pd_plugins.mock.answers import error


@dataclass
class Faults:
    fail_rate: float = 0.0      # answer HTTP 500
    garbage_rate: float = 0.0   # answer 200 with a body that is not JSON
    hang_rate: float = 0.0      # never answer
    # close the connection after this many streamed tokens, halfway through the next (0: never)
    break_stream_after: int = 0

    def updated(self, changes: dict) -> Faults:
        """These faults with `changes` (from the network: msgspec checks the types)."""
        return msgspec.convert({**asdict(self), **changes}, Faults)

    def roll(self, rng: random.Random) -> Awaitable[web.Response] | None:
        """The answer of an injected failure for this request, or None (serve it)."""
        roll = rng.random()
        if roll < self.fail_rate:
            return _now(error(500, "injected failure"))
        roll -= self.fail_rate
        if roll < self.garbage_rate:
            return _now(web.Response(body=b"<html>garbage", content_type="application/json"))
        roll -= self.garbage_rate
        if roll < self.hang_rate:
            return _hang()
        return None


async def _now(response: web.Response) -> web.Response:
    return response


async def _hang() -> web.Response:
    await asyncio.sleep(3600)
    return error(500, "hung")
