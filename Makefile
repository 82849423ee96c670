# Two entry points for a fresh machine: `make demo` and `make test` (both bootstrap .venv).
PY := .venv/bin/python
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: bootstrap demo test test-unit test-e2e test-gpu bench-router clean

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) -m pd_plugins.demo

test: bootstrap
	$(PYTEST) tests

test-unit: bootstrap
	$(PYTEST) tests/unit

test-e2e: bootstrap
	$(PYTEST) tests/e2e

# The same end-to-end suite on a CUDA machine (see docs/gpu.md); skips where there is no GPU.
test-gpu:
	@bash scripts/test_gpu.sh

# pd-router vs vllm-router and sglang-router on mock engines: docs/benchmarks.md, docs/img/ (~8 min;
# `$(PY) bench/router_overhead.py --quick` for a 1-minute smoke run). Peers go in bench/.venv-peers.
bench-router: bootstrap
	$(PY) bench/router_overhead.py

clean:
	rm -rf .venv .venv-gpu
