#!/usr/bin/env bash
# `make test-gpu`: the end-to-end PD suite on CUDA with the regular (CUDA) vLLM build.
#   PD_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct PD_GPU_MOE_MODEL=/models/<small MoE> make test-gpu
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

VENV=.venv-gpu
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
if ! "$VENV/bin/python" -c "import vllm, nixl, pd_plugins, pytest" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install "vllm==$VLLM_VERSION" "nixl==1.5.1" pytest pytest-timeout requests
  "$VENV/bin/pip" install --no-deps -e .
fi
PD_TEST_DEVICE=cuda HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -p no:cacheprovider tests/e2e "$@"
