from pathlib import Path

import pytest

from tests.e2e.deployments import FULL_MATRIX, DeploymentPool, aggregated_references

# tiny-mixtral's cells run only in the full matrix: CI starts no reference server for it
E2E_MODELS = ["tiny-llama", "tiny-qwen3-moe"] + (["tiny-mixtral"] if FULL_MATRIX else [])
HERE = Path(__file__).resolve().parent

# Modules that share the package's PD pairs (DeploymentPool keeps the last one) run last, in this
# order, each starting on the pair the one before ended on, so that the pool reuses a pair instead
# of stopping and restarting two vLLM servers (about a minute each time on the CI host):
# multi-turn ends on llama pull+cache; the router tests go pull+cache, push+nocache; test_pd_nixl
# push+nocache ... pull+cache; test_faults pull+cache first. Every other module runs before them,
# in file order.
SHARED_PAIR_CHAIN = ("test_multi_turn_vllm.py", "test_router_vllm.py", "test_pd_nixl.py",
                     "test_faults.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    positions = [i for i, item in enumerate(items) if Path(item.path).resolve().parent == HERE]
    ours = [items[i] for i in positions]

    def rank(item: pytest.Item) -> int:
        name = Path(item.path).name
        return SHARED_PAIR_CHAIN.index(name) + 1 if name in SHARED_PAIR_CHAIN else 0

    for i, item in zip(positions, sorted(ours, key=rank)):  # sorted() is stable
        items[i] = item


@pytest.fixture(scope="session")
def references():
    refs = aggregated_references(E2E_MODELS)
    for model, outputs in refs.items():
        for prompt, out in outputs.items():
            # A broken transfer must not be able to hide behind a degenerate model.
            assert len(set(out)) >= 8, f"{model}: greedy output not diverse: {out}"
    return refs


@pytest.fixture(scope="package")
def pool():
    """Package scope: the last pair is stopped when tests/e2e ends, not kept (two idle vLLM servers,
    ~6 GiB) through the router, SGLang and unit tests that follow."""
    deployments = DeploymentPool()
    yield deployments
    deployments.close()
