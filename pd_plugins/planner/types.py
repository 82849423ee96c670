"""The answer both planners give (split.py's search, dynamo_rule.py's formula): a P:D split."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Split:
    """A P:D split: how many instances serve prefill, how many decode."""

    prefill: int
    decode: int

    @property
    def instances(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"{self.prefill}P:{self.decode}D"
