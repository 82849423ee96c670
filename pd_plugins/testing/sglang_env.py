"""SGLang's package on a CPU machine, for the adapter tests (tests/sglang).

SGLang cannot run as an engine without CUDA, but its disaggregation modules, plugin registry and
argument parser import once two GPU-only packages are stubbed (named fakes: nothing calls them):
`sgl_kernel` (CUDA kernels; SGLang's own tests stub it the same way) and `torchvision` (imported by
multimodal helpers; PyPI's build does not load beside the CPU torch). The environment is
.venv-sglang (scripts/bootstrap_sglang.sh): SGLang's package layered over .venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from unittest.mock import MagicMock

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
STUBBED = ("sgl_kernel", "torchvision")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__getattr__ = lambda name: MagicMock(name=f"{module.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def stub_gpu_only_packages() -> None:
    """Call before importing sglang.srt."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
