import pytest

from tests.e2e.deployments import DeploymentPool, aggregated_references

E2E_MODELS = ["tiny-llama", "tiny-qwen3-moe", "tiny-mixtral"]


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
