#!/usr/bin/env bash
# `make test-gpu`: the PD suites on CUDA. Two lanes, each in its own environment (vLLM and SGLang
# pin different torch builds):
#   vllm:   tests/e2e with the regular (CUDA) vLLM build, in .venv-gpu
#   sglang: tests/gpu_sglang with SGLang's CUDA build and pd-nixl on GPU memory, in .venv-gpu-sglang
#   PD_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct PD_GPU_MOE_MODEL=/models/<small MoE> make test-gpu
#   PD_GPU_LANES=sglang make test-gpu      # one lane only (pytest arguments go to every lane run)
# Skips, successfully and saying why, on a machine without an NVIDIA GPU. See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "test-gpu: SKIPPED: no NVIDIA GPU visible here (nvidia-smi -L failed); nothing was run."
  exit 0
fi
if [[ -z "${PD_GPU_MODEL:-}" ]]; then
  echo "test-gpu: set PD_GPU_MODEL to a local model folder (e.g. Qwen2.5-0.5B-Instruct)" >&2
  exit 2
fi
LANES=${PD_GPU_LANES:-vllm,sglang}
for lane in ${LANES//,/ }; do
  if [[ "$lane" != vllm && "$lane" != sglang ]]; then
    echo "test-gpu: PD_GPU_LANES takes vllm and/or sglang, comma-separated; not '$lane'" >&2
    exit 2
  fi
done
status=0

if [[ ",$LANES," == *",vllm,"* ]]; then
  VENV=.venv-gpu
  VLLM_VERSION=${VLLM_VERSION:-0.32.0}
  if ! "$VENV/bin/python" -c "import vllm, nixl, pd_plugins, pytest" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install "vllm==$VLLM_VERSION" "nixl==1.5.1" pytest pytest-timeout requests
    "$VENV/bin/pip" install --no-deps -e .
  fi
  PD_TEST_DEVICE=cuda HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -p no:cacheprovider tests/e2e "$@" \
    || status=$?
fi

if [[ ",$LANES," == *",sglang,"* ]]; then
  VENV=.venv-gpu-sglang
  SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}  # the release patches/sglang_backends.py is checked against
  if ! "$VENV/bin/python" -c "import sglang, nixl, pd_plugins, pytest" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install "sglang[all]==$SGLANG_VERSION" "nixl==1.5.1" pytest pytest-timeout requests pyyaml
    "$VENV/bin/pip" install -e .  # pd-router's own dependencies too (no engine extra)
  fi
  PD_TEST_DEVICE=cuda HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -p no:cacheprovider tests/gpu_sglang "$@" \
    || status=$?
fi
exit $status
