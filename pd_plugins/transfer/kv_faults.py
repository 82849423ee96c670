"""Fault injection into KV hand-offs, for tests and for users who want to see verification work.

A spec is a `;`-separated list of `kind[:key=value,...]`, e.g.
`flip_slot:match=kvfault-,limit=50`:

- kinds: `corrupt` (a landed block), `reuse` (a block reused before it is read), `drop_write`
  (a push WRITE skipped, its notification sent), `stale_chunk` (another prompt's KV stored under
  this prompt's key), `flip_slot` (a byte of a published pool slot). Which transport injects
  which is in docs/plans/kv-verification.md §6; a transport ignores kinds it has no hook for.
- keys: `match`, a substring of the request id (or room) that must be present (default: every
  request; a test gives its requests ids like `kvfault-17`, vLLM builds its ids from the
  X-Request-Id header); `every`, inject into every n-th matching request (1: each); `limit`,
  at most this many injections; `seed`, which byte is hit (`position`).

Set it where the transport's options are (vLLM: `kv_connector_extra_config.faults`; SGLang:
`PD_KV_FAULTS`). It is refused (OptionError: the engine does not start) unless the engine's
environment says `PD_KV_FAULTS_ALLOWED=1`, and always when it says `PD_PRODUCTION=1`: a config
file or a copied command line alone can never damage a deployment's KV. Every injection is
logged with its request id and counted per kind (`injected`), so a test compares what was
injected with what was detected, exactly.

Engine-agnostic: the standard library only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Mapping

from pd_plugins.transfer.options import OptionError, truthy

logger = logging.getLogger(__name__)

FAULTS_VAR = "PD_KV_FAULTS"
ALLOWED_VAR = "PD_KV_FAULTS_ALLOWED"
PRODUCTION_VAR = "PD_PRODUCTION"
KINDS = ("corrupt", "reuse", "drop_write", "stale_chunk", "flip_slot")
_KEYS = ("match", "every", "limit", "seed")


@dataclass(frozen=True)
class FaultRule:
    kind: str
    match: str = ""
    every: int = 1
    limit: int | None = None
    seed: int = 0


def parse(spec: str, who: str) -> tuple[FaultRule, ...]:
    """The rules of a spec; OptionError naming the kind, key or value it cannot take."""
    rules = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, rest = part.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise OptionError(f"{who}: fault kind {kind!r} is not one of {', '.join(KINDS)}")
        values: dict[str, object] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if key not in _KEYS or not eq:
                raise OptionError(f"{who}: fault {kind}: {item!r} is not one of "
                                  f"{'=, '.join(_KEYS)}=")
            if key == "match":
                values[key] = value.strip()
                continue
            try:
                number = int(value)
            except ValueError:
                raise OptionError(f"{who}: fault {kind}: {key} must be an integer, "
                                  f"got {value!r}") from None
            if number < (1 if key == "every" else 0):
                raise OptionError(f"{who}: fault {kind}: {key} must be "
                                  f"{'at least 1' if key == 'every' else 'non-negative'}")
            values[key] = number
        rules.append(FaultRule(kind, **values))
    return tuple(rules)


def refusal(environ: Mapping[str, str]) -> str | None:
    """Why fault injection may not run in an engine with this environment (None: it may)."""
    def flag(name: str) -> bool:
        try:
            return truthy(environ.get(name, ""))
        except ValueError:
            return name == PRODUCTION_VAR  # an unreadable production flag counts as set
    if flag(PRODUCTION_VAR):
        return f"{PRODUCTION_VAR} is set: fault injection is never allowed in production"
    if not flag(ALLOWED_VAR):
        return (f"fault injection needs {ALLOWED_VAR}=1 in the engine's environment (a config "
                f"alone cannot turn it on)")
    return None


class KvFaults:
    """The faults one engine process injects. Thread-safe; `none()` injects nothing."""

    def __init__(self, rules: tuple[FaultRule, ...] = ()) -> None:
        self.rules = rules
        self._lock = threading.Lock()
        self._matched = [0] * len(rules)
        self._done = [0] * len(rules)
        self.injected: dict[str, int] = {kind: 0 for kind in KINDS}

    @classmethod
    def none(cls) -> KvFaults:
        return cls()

    @classmethod
    def from_spec(cls, spec: str | None, who: str,
                  environ: Mapping[str, str] | None = None) -> KvFaults:
        """The faults of a spec (None or empty: none), refused as the module doc says."""
        if not spec or not spec.strip():
            return cls.none()
        rules = parse(spec, who)
        why = refusal(os.environ if environ is None else environ)
        if why is not None:
            raise OptionError(f"{who}: faults {spec!r} refused: {why}")
        logger.error("%s: KV FAULT INJECTION IS ON (%s): answers of matching requests are "
                     "computed from damaged KV unless verification catches it", who, spec)
        return cls(rules)

    @property
    def enabled(self) -> bool:
        return bool(self.rules)

    def handles(self, kind: str) -> bool:
        return any(rule.kind == kind for rule in self.rules)

    def take(self, kind: str, target: str) -> FaultRule | None:
        """Whether to inject `kind` into `target` (a request id or room) now: the rule to apply
        (counted as injected: call it only where the fault is then made), or None."""
        if not self.rules:
            return None
        with self._lock:
            for i, rule in enumerate(self.rules):
                if rule.kind != kind or rule.match not in target:
                    continue
                if rule.limit is not None and self._done[i] >= rule.limit:
                    continue
                self._matched[i] += 1
                if (self._matched[i] - 1) % rule.every:
                    continue
                self._done[i] += 1
                self.injected[kind] += 1
                logger.warning("KV fault injected: %s into %s (%d of this kind)", kind, target,
                               self.injected[kind])
                return rule
        return None


def position(rule: FaultRule, target: str, size: int) -> int:
    """Which of `size` positions (a byte, a block) the fault hits: fixed by the rule's seed and
    the target, so a failing run can be replayed."""
    h = hashlib.blake2b(f"{rule.seed}:{target}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % size
