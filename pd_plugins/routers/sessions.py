"""Conversations and the decode worker that holds each one's KV (ConServe's pinning).

A session is named by the client (x-session-id and friends, or the body's `session_id` / `user`;
request.py reads them) or found automatically: a request whose prompt extends the prompt of an
earlier one is its next turn (their prefix block keys chain, and the new prompt goes on with the
earlier one's partial last block). After every successful turn the
table records the decode worker that served it; the `session_pin` filter sends the next turn there,
where the conversation's KV is cached, and the `append_prefill` decider may skip the prefill leg.

The table is bounded twice: entries unused for `ttl_s` expire, and past `max_sessions` the least
recently used go first, so memory stays flat under millions of conversations. The proxy and the
cluster simulator both call `resolve` before scheduling and `record` after a turn succeeds.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from pd_plugins.routers.config import SessionSpec
from pd_plugins.routers.policy.base import RequestInfo


@dataclass(slots=True)
class Session:
    decode_url: str | None          # where its KV is (None: not pinned yet, or unpinned)
    turns: int = 0                  # turns served so far
    resident_tokens: int = 0        # prompt tokens of its last turn, cached on decode_url
    last_use: float = 0.0
    auto: bool = False              # found by prefix detection (`auto-<random>`), not client-named
    chain_key: int | None = None    # its last turn's last prompt block key (detection's chain)
    # its last turn's prompt after that block (token ids, or text): a next turn extends it too
    tail: tuple[int, ...] | str | None = None


class SessionTable:
    def __init__(self, spec: SessionSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec, self.clock = spec, clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        # last prompt block key of a served turn -> its session (automatic detection)
        self._chains: OrderedDict[int, str] = OrderedDict()
        # Replicas sharing sessions (routers/replica_channels.py) each set their own, so that
        # automatic ids never collide between them.
        self.auto_prefix = "auto-"
        self.counts = {"pinned": 0, "repinned": 0, "expired": 0, "evicted": 0, "detected": 0}

    def __len__(self) -> int:
        return len(self._sessions)

    # -- before scheduling ----------------------------------------------------------------------
    def resolve(self, info: RequestInfo) -> None:
        """Fill in the request's session, turn and pinned decode worker (if any)."""
        now = self.clock()
        self._expire(now)
        if info.session_id is None and self.spec.detect:
            info.session_id = self._detect(info)
        if info.session_id is None:
            return
        session = self._sessions.get(info.session_id)
        if session is None:
            return
        info.turn = session.turns
        info.pinned_decode = session.decode_url
        info.resident_tokens = session.resident_tokens

    def _detect(self, info: RequestInfo) -> str | None:
        """The session whose last turn's prompt is the longest prefix of this prompt: its full
        blocks (the chain key) and its partial last block (the tail). Without the tail check, a
        short prompt sharing a long system prompt made every later request with that system
        prompt its next turn, all pinned to one decode."""
        keys = info.block_keys
        for i in range(len(keys) - 1, -1, -1):
            session_id = self._chains.get(keys[i])
            session = self._sessions.get(session_id) if session_id is not None else None
            if session is None:
                continue
            if session.tail and info.prompt is not None:
                start = (i + 1) * info.block_width
                head = info.prompt[start:start + len(session.tail)]
                if (head if isinstance(head, str) else tuple(head)) != session.tail:
                    continue  # shares its full blocks, not its tail: another conversation
            self.counts["detected"] += 1
            return session_id
        return None

    # -- after a successful turn ----------------------------------------------------------------
    def record(self, info: RequestInfo, decode_url: str) -> str:
        """The turn ran on `decode_url`: pin the session there. Returns the session id (a new
        automatic one when the request had none)."""
        now = self.clock()
        session_id = info.session_id
        if session_id is None:
            if not self.spec.detect or not info.block_keys:
                return ""
            # unguessable: a client may name any session id, and one that named a sequential
            # `auto-N` took over that conversation's pin (or was merged into the next one found)
            session_id = info.session_id = f"{self.auto_prefix}{secrets.token_hex(8)}"
            session = Session(None, auto=True)
        else:
            session = self._sessions.pop(session_id, None) or Session(None)
        if session.decode_url != decode_url:
            self.counts["repinned" if session.decode_url else "pinned"] += 1
        session.decode_url, session.turns = decode_url, session.turns + 1
        session.resident_tokens, session.last_use = info.prompt_tokens, now
        self._sessions[session_id] = session  # most recently used
        self._bound()
        if info.block_keys:
            session.chain_key = info.block_keys[-1]
            session.tail = _tail(info)
            self._chain(session.chain_key, session_id)
        return session_id

    def adopt(self, session_id: str, session: Session) -> None:
        """Take a session another router replica recorded (routers/replica_channels.py): it
        replaces this table's entry, as the most recently used, and its chain key lets prefix
        detection find it here too."""
        self._sessions.pop(session_id, None)
        session.last_use = self.clock()
        self._sessions[session_id] = session
        self._bound()
        if session.chain_key is not None:
            self._chain(session.chain_key, session_id)

    def _chain(self, key: int, session_id: str) -> None:
        if not self.spec.detect:
            return
        self._chains[key] = session_id
        self._chains.move_to_end(key)
        while len(self._chains) > 4 * self.spec.max_sessions:
            self._chains.popitem(last=False)

    def count(self, event: str) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1

    def _bound(self) -> None:
        while len(self._sessions) > self.spec.max_sessions:
            self._sessions.popitem(last=False)
            self.counts["evicted"] += 1

    def forget_worker(self, decode_url: str) -> int:
        """A decode worker left: its sessions re-pin on their next turn. Returns how many."""
        moved = 0
        for session in self._sessions.values():
            if session.decode_url == decode_url:
                session.decode_url = None
                moved += 1
        return moved

    def _expire(self, now: float) -> None:
        ttl = self.spec.ttl_s
        while self._sessions:
            session_id, session = next(iter(self._sessions.items()))
            if now - session.last_use < ttl:
                return
            del self._sessions[session_id]
            self.counts["expired"] += 1

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)


def _tail(info: RequestInfo) -> tuple[int, ...] | str | None:
    """The prompt after its last full block (less than a block: bounded per session)."""
    if info.prompt is None or not info.block_width:
        return None
    rest = info.prompt[len(info.block_keys) * info.block_width:]
    return rest if isinstance(rest, str) else tuple(rest)
