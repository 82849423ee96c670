"""The mock's KV handshake between a prefill and its decode (the NIXL side channel / SGLang
bootstrap port): no KV moves, only the prompt's digest, so a decode given another prompt's KV
notices (HTTP 409) as a real engine would compute garbage.

A prefill registers its prompt's digest under the transfer key (a "room") on its side server; the
decode reads it from there, waiting up to --transfer-timeout-s for a prefill that has not
finished, as a real decode does. Reading it for good frees the room, and the prefill's KV with it.

Transfer keys: vLLM pull: remote_request_id from the prefill's kv_transfer_params; vLLM push: the
shared X-Request-Id; SGLang: bootstrap_room.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable, Coroutine

import aiohttp
from aiohttp import web


class SideChannel:
    """A prefill's rooms (served on the side port) and a decode's client for other engines'."""

    def __init__(self, engine: str, engine_id: str, side_port: int, transfer_timeout_s: float) -> None:
        self.engine, self.engine_id, self.side_port = engine, engine_id, side_port
        self.transfer_timeout_s = transfer_timeout_s
        self.rooms: dict[str, asyncio.Future] = {}
        # room key -> (what frees the prefill's KV, the timer that gives up on the decode)
        self._holds: dict[str, tuple[Callable[[], None], asyncio.TimerHandle | None]] = {}
        self._background: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self.session = aiohttp.ClientSession()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.session.close()

    # -- the prefill's side ------------------------------------------------------------------
    def transfer_key(self, request_id: str | None, body: dict, kv: dict) -> str | None:
        """Where a leg's KV is registered (prefill) or read (decode); None: not a PD leg.
        `request_id`: the request's X-Request-Id."""
        if self.engine == "sglang":
            room = body.get("bootstrap_room")
            return None if room is None else str(room)
        if kv.get("do_remote_decode"):  # vLLM prefill leg: pull key, and push key
            return request_id or uuid.uuid4().hex
        if kv.get("do_remote_prefill"):
            return str(kv.get("remote_request_id"))
        return None

    def register(self, key: str, digest: str, free: Callable[[], None],
                 hold_s: float | None = None) -> None:
        """The prefill's KV under `key` is ready for a decode to read; `free()` once the decode
        read it, or after `hold_s` seconds without one."""
        future = self.rooms.setdefault(key, asyncio.get_running_loop().create_future())
        if not future.done():
            future.set_result(digest)
        self._free(key)  # a retry under the same key: the KV it replaces is nobody's
        timer = asyncio.get_running_loop().call_later(hold_s, self._free, key) if hold_s else None
        self._holds[key] = (free, timer)

    def _free(self, key: str) -> None:
        free, timer = self._holds.pop(key, (None, None))
        if timer is not None:
            timer.cancel()
        if free is not None:
            free()

    def transfer_params(self, key: str | None) -> dict[str, Any]:
        """The prefill answer's kv_transfer_params: where the decode reads the KV (vLLM's names)."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_request_id": key, "remote_block_ids": [list(range(3))],
                "remote_host": "127.0.0.1", "remote_port": self.side_port, "tp_size": 1}

    def rooms_held(self) -> int:
        return sum(1 for f in self.rooms.values() if f.done())

    async def room(self, request: web.Request) -> web.Response:
        """GET /room/{key} on the side port: the digest registered there (waiting for it); read
        once, then freed, unless `?peek=1`."""
        key = request.match_info["key"]
        future = self.rooms.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            digest = await asyncio.wait_for(asyncio.shield(future), self.transfer_timeout_s)
        except asyncio.TimeoutError:
            return web.Response(status=404, text="no such transfer")
        if request.query.get("peek"):  # a modelled decode checks early and reads at its first token
            return web.Response(text=digest)
        self.rooms.pop(key, None)
        self._free(key)
        return web.Response(text=digest)

    # -- the decode's side -------------------------------------------------------------------
    async def fetch(self, kv: dict, body: dict, key: str, peek: bool = False) -> str | None:
        """The digest the prefill registered under `key` (waiting for it); reading it frees the
        transfer there, unless `peek`."""
        if self.engine == "sglang":
            host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        else:
            host, port = kv.get("remote_host"), kv.get("remote_port")
        url = f"http://{host}:{port}/room/{key}" + ("?peek=1" if peek else "")
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(
                    total=self.transfer_timeout_s)) as resp:
                return (await resp.text()) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    def spawn(self, coro: Coroutine) -> None:
        """Run `coro` past the request that started it (stopped with the server)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def handoff(self, kv: dict, body: dict, key: str, digest: str, timed: bool) -> KvHandoff:
        return KvHandoff(self, kv, body, key, digest, timed)


class KvHandoff:
    """A remote decode taking its prefill's KV: `before_start()`, then `at_first_token()`; each
    says whether the KV is the decode's prompt's. `abandon()` if the decode's client leaves.

    `timed` False (fixed delays: the KV moves at once): the decode reads the KV for good before
    it starts. True (the engine model times the transfer inside the decode): a vLLM pull starts at
    once, push and SGLang first wait for the prefill (peeking); either checks the KV at its first
    token, then reads it for good in the background, which frees the prefill's KV.
    """

    def __init__(self, side: SideChannel, kv: dict, body: dict, key: str, digest: str, timed: bool) -> None:
        self.side, self.kv, self.body, self.key, self.digest = side, kv, body, key, digest
        self.timed = timed
        self.pull = side.engine == "vllm" and "remote_block_ids" in kv
        self.waited = False  # the decode waited for its prefill before it started
        self._peek: asyncio.Task | None = None
        self._taken = False

    async def before_start(self) -> bool:
        if not self.timed:
            self._taken = self.waited = True
            return await self.side.fetch(self.kv, self.body, self.key) == self.digest
        self._peek = asyncio.create_task(self.side.fetch(self.kv, self.body, self.key, peek=True))
        if self.pull:  # the prefill has answered: its KV is there
            return True
        held = await self._peek  # the prefill is still running; its KV lands when done
        self.waited = True
        if held != self.digest:
            self._take_later()
            return False
        return True

    async def at_first_token(self) -> bool:
        if self._peek is None:
            return True  # taken and checked before the start
        held = await self._peek
        self._take_later()
        return held == self.digest

    def abandon(self) -> None:
        if self._peek is not None and not self._taken:
            self._peek.cancel()
            self._take_later()

    def _take_later(self) -> None:
        self._taken = True
        self.side.spawn(self.side.fetch(self.kv, self.body, self.key))
