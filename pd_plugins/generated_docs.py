"""Parts of docs/ rendered from code (the options table, the compatibility matrix): the text
between two marker comments is the rendering, rewritten by a module's `--update FILE` and compared
by a fast test, so the document cannot drift from the code."""

from __future__ import annotations

import sys
from typing import Callable


def with_rendering(document: str, begin: str, end: str, rendering: str) -> str:
    """`document` with `rendering` between its `begin` and `end` markers."""
    start, stop = document.index(begin) + len(begin), document.index(end)
    return document[:start] + "\n\n" + rendering + "\n" + document[stop:]


def update_main(argv: list[str], render_into: Callable[[str], str], usage: str,
                markdown: Callable[[], str] | None = None) -> int:
    """`--update FILE` rewrites FILE's rendered part; `--markdown` prints the rendering alone."""
    if argv == ["--markdown"] and markdown is not None:
        sys.stdout.write(markdown())
        return 0
    if len(argv) == 2 and argv[0] == "--update":
        with open(argv[1], encoding="utf-8") as fh:
            rendered = render_into(fh.read())  # before the file is truncated: a failure keeps it
        with open(argv[1], "w", encoding="utf-8") as fh:
            fh.write(rendered)
        return 0
    sys.stderr.write(f"usage: {usage}\n")
    return 2
