"""`pd-router` console script. The router itself lands with the router-core issue."""

from __future__ import annotations

import sys


def main() -> None:
    sys.exit("pd-router: not implemented yet in this release (see docs/architecture.md)")


if __name__ == "__main__":
    main()
