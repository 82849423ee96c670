"""A Kubernetes label selector string (`kubectl -l` syntax) as the client library's selector.

Parsed at startup so a typo is a configuration error, not an API error on every retry.
"""

from __future__ import annotations

import re

from lightkube import operators

from pd_plugins.routers.config import ConfigError

_NAME = r"[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)?"
_SET = re.compile(rf"^(?P<key>{_NAME})\s+(?P<op>in|notin)\s+\((?P<values>[^()]*)\)$")
_BINARY = re.compile(rf"^(?P<key>{_NAME})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})$")
_UNARY = re.compile(rf"^(?P<neg>!?)\s*(?P<key>{_NAME})$")


def _terms(text: str) -> list[str]:
    """Split on the commas outside `( )`."""
    terms, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t.strip() for t in terms]


def parse_label_selector(text: str) -> list[tuple[str, operators.Operator]]:
    if not text.strip():
        raise ConfigError("the pod selector is empty: it would pick every pod in the namespace")
    parsed = []
    for term in _terms(text):
        if m := _SET.match(term):
            values = [v.strip() for v in m["values"].split(",")]
            if not all(re.fullmatch(_VALUE, v) for v in values):
                raise ConfigError(f"selector term {term!r}: bad value in the set")
            op = operators.in_(values) if m["op"] == "in" else operators.not_in(values)
            parsed.append((m["key"], op))
        elif m := _BINARY.match(term):
            value = m["value"]
            op = operators.not_equal(value) if m["op"] == "!=" else operators.equal(value)
            parsed.append((m["key"], op))
        elif m := _UNARY.match(term):
            parsed.append((m["key"], operators.not_exists() if m["neg"] else operators.exists()))
        else:
            raise ConfigError(f"selector term {term!r} is not a label selector term "
                              "(key=value, key!=value, key, !key, key in (a,b), key notin (a,b))")
    return parsed
