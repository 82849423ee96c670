"""Conversation pins shared by several router replicas through Redis (`sessions.redis_url`).

Each router keeps its own SessionTable (routers/sessions.py); this module keeps the tables of all
replicas in step for sessions that the client names (x-session-id and friends). Before a named
request is scheduled, `SessionSharing.pull` reads the session from Redis and adopts it when it is
newer than the local entry (more turns), so a turn that a load balancer sends to another replica
still lands on the decode worker that holds the conversation's KV. After a successful turn,
`SessionSharing.push` writes the new pin in the background. Sessions found by prefix detection
(`auto-N` ids) stay local: their ids are per router and their prefix chains are not shared.

One Redis string per session, `<redis_prefix><session id>` = JSON {decode_url, turns,
resident_tokens}, written with EXPIRE = `sessions.ttl_s`, so Redis forgets idle conversations too.

Redis is a helper, never a dependency of serving: every command has a timeout
(`sessions.redis_timeout_s`); a failure is counted (`pd_router_session_events{event="store_error"}`),
logged at most once a minute, and the router then decides from its own table, without trying Redis
again for `retry_after_s`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable

import msgspec

from pd_plugins.routers.config import ConfigError, SessionSpec
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.sessions import Session, SessionTable

log = logging.getLogger("pd_router.sessions")


class _Stored(msgspec.Struct, omit_defaults=True):
    decode_url: str | None = None
    turns: int = 0
    resident_tokens: int = 0


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(_Stored).decode


class RedisSessionStore:
    """Sessions in Redis: `load`, `save` (with a TTL) and `aclose`. Redis errors propagate."""

    def __init__(self, url: str, prefix: str = "pd-router:session:", timeout_s: float = 0.25) -> None:
        self.check_installed()
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url, self.prefix = url, prefix
        # One retry without backoff: enough to replace a pooled connection that a Redis restart
        # closed, without multiplying the wait when Redis is down.
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                        retry=Retry(NoBackoff(), 1))

    @staticmethod
    def check_installed() -> None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError:
            raise ConfigError("sessions.redis_url needs the redis package (redis-py): "
                              "pip install 'pd-plugins[redis]'") from None

    def key(self, session_id: str) -> str:
        return self.prefix + session_id

    async def load(self, session_id: str) -> Session | None:
        raw = await self._redis.get(self.key(session_id))
        if raw is None:
            return None
        try:
            stored = _decode(raw)
        except msgspec.DecodeError:
            log.warning("session %r: unreadable value in Redis, ignored", session_id)
            return None
        return Session(stored.decode_url, stored.turns, stored.resident_tokens)

    async def save(self, session_id: str, session: Session, ttl_s: float) -> None:
        value = _encode(_Stored(session.decode_url, session.turns, session.resident_tokens))
        await self._redis.set(self.key(session_id), value, ex=max(1, math.ceil(ttl_s)))

    async def ping(self) -> None:
        await self._redis.ping()

    async def aclose(self) -> None:
        await self._redis.aclose()


class SessionSharing:
    """A router's SessionTable kept in step with a RedisSessionStore, never failing a request."""

    def __init__(self, table: SessionTable, store: RedisSessionStore, spec: SessionSpec,
                 prefix_index=None, block_size: int = 16, retry_after_s: float = 2.0,
                 log_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.table, self.store, self.spec = table, store, spec
        self.prefix_index, self.block_size = prefix_index, block_size
        self.retry_after_s, self.log_every_s, self.clock = retry_after_s, log_every_s, clock
        self.timeout_s = spec.redis_timeout_s
        self._down_until = 0.0       # no Redis command before this (after a failure)
        self._logged_at = -math.inf
        self._failing = False
        self._saves: set[asyncio.Task] = set()
        for event in ("store_error", "store_adopted"):
            table.counts.setdefault(event, 0)

    async def start(self) -> None:
        """Check Redis once at startup: a warning when it is unreachable (serving goes on)."""
        try:
            await asyncio.wait_for(self.store.ping(), self.timeout_s * 4)
            log.info("sessions shared through Redis at %s", _redacted(self.store.url))
        except Exception as exc:  # noqa: BLE001 - any Redis trouble means "local table only"
            self._failed(exc)

    # -- before scheduling ----------------------------------------------------------------------
    async def pull(self, info: RequestInfo) -> None:
        """Adopt Redis's copy of the request's (named) session when it is newer than this
        router's. The approximate prefix index then assumes the pinned worker holds the previous
        turn's prompt, i.e. this prompt's first `resident_tokens` (what this router would know had
        it routed that turn itself; `session_pin` checks it). With KV events the index knows."""
        session_id = info.session_id
        if session_id is None or self.clock() < self._down_until:
            return
        try:
            remote = await asyncio.wait_for(self.store.load(session_id), self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return
        self._succeeded()
        if remote is None:
            return
        local = self.table.get(session_id)
        if local is None or remote.turns > local.turns:
            self.table.adopt(session_id, remote)
            self.table.counts["store_adopted"] += 1
            if self.prefix_index is not None and remote.decode_url and remote.resident_tokens:
                resident = info.block_keys[:remote.resident_tokens // self.block_size]
                self.prefix_index.record_routed(remote.decode_url, resident)

    # -- after a successful turn ----------------------------------------------------------------
    def push(self, session_id: str) -> None:
        """Write the session's new pin to Redis in the background."""
        session = self.table.get(session_id) if session_id else None
        if session is None or session.auto or self.clock() < self._down_until:
            return
        copy = Session(session.decode_url, session.turns, session.resident_tokens)
        task = asyncio.get_running_loop().create_task(self._save(session_id, copy))
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

    async def _save(self, session_id: str, session: Session) -> None:
        try:
            await asyncio.wait_for(self.store.save(session_id, session, self.spec.ttl_s), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
        else:
            self._succeeded()

    # -- lifecycle --------------------------------------------------------------------------------
    async def aclose(self) -> None:
        if self._saves:  # let the last pins reach Redis, briefly
            await asyncio.wait(set(self._saves), timeout=self.timeout_s * 2)
            for task in list(self._saves):
                task.cancel()
            await asyncio.gather(*self._saves, return_exceptions=True)
        try:
            await self.store.aclose()
        except Exception:  # noqa: BLE001
            pass

    # -- failures -------------------------------------------------------------------------------
    def _failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.table.counts["store_error"] += 1
        self._down_until = now + self.retry_after_s
        self._failing = True
        if now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
            log.warning("Redis session store %s failed (%s); routing from this router's own table "
                        "(%d Redis errors so far; logged at most once a minute)",
                        _redacted(self.store.url), reason, self.table.counts["store_error"])

    def _succeeded(self) -> None:
        if self._failing:
            self._failing = False
            log.info("Redis session store %s reachable again", _redacted(self.store.url))


def _redacted(url: str) -> str:
    """The URL without a password (redis://user:secret@host -> redis://user:***@host)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"
