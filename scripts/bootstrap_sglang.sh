#!/usr/bin/env bash
# Build .venv-sglang, idempotently: SGLang's Python package (requirements/sglang-cpu.lock) layered
# over .venv, for the SGLang adapter tests (tests/sglang). SGLang cannot run as an engine on a CPU
# machine (CUDA-only kernels); its modules import with sgl_kernel stubbed
# (pd_plugins/testing/sglang_env.py). Separate from .venv because triton must stay out of vLLM's.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SGLANG_VENV:-.venv-sglang}
BASE=${VENV_BASE:-.venv}
LOCK=requirements/sglang-cpu.lock
STAMP="$VENV/.pd-bootstrap"
# one build at a time (bootstrap.sh starts this in the background; a rerun must not race it)
exec 9>"$VENV.lock"
flock 9
# the base's interpreter is part of the stamp: a base rebuilt on another one rebuilds this too
want=$( (cat "$LOCK" scripts/bootstrap_sglang.sh; readlink -f "$BASE/bin/python") | sha256sum | cut -c1-16)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
echo "bootstrap: building $VENV (SGLang's package over $BASE); about a minute once"
PYTHON=$(readlink -f "$BASE/bin/python")
"$PYTHON" -m venv --clear "$VENV"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
base_site=$("$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir (not a bare path) so .venv's own .pth files (the editable pd-plugins) apply too
echo "import site; site.addsitedir('$(readlink -f "$base_site")')" > "$site/pd_base_venv.pth"
"$VENV/bin/python" -m pip --disable-pip-version-check install -q --no-deps -r "$LOCK"
echo "$want" > "$STAMP"
echo "bootstrap: $VENV done"
