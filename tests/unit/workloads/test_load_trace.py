"""load_trace dispatch, the TRACES registry and PD_TRACES_DIR."""

from __future__ import annotations

import pytest

from pd_plugins.workloads import TRACES, load_trace, traces_dir


def test_traces_resolve_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_TRACES_DIR", str(tmp_path))
    assert traces_dir() == tmp_path
    assert set(TRACES) == {"mooncake_conv", "azure_conv", "azure_code"}
    assert TRACES["azure_code"] == tmp_path / "azure_llm_2023/AzureLLMInferenceTrace_code.csv"
    monkeypatch.setenv("PD_TRACES_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="PD_TRACES_DIR"):
        TRACES["mooncake_conv"]


def test_load_trace_picks_loader_by_suffix(write):
    moon = write("m.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 2, '
                            '"hash_ids": [4, 5]}\n')
    azure = write("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                           "2023-11-16 18:15:46.6805900,374,44\n")
    assert load_trace(moon)[0].block_hashes == (4, 5)
    assert load_trace(str(azure))[0].input_tokens == 374
    with pytest.raises(ValueError, match="unknown trace"):
        load_trace(write("x.txt", ""))
    with pytest.raises(ValueError, match="unknown trace"):
        load_trace("no_such_trace")


def test_load_trace_by_name():
    try:
        path = TRACES["azure_code"]
    except FileNotFoundError:
        pytest.skip("trace files not available")
    if not path.is_file():
        pytest.skip(f"{path} missing")
    reqs = load_trace("azure_code")
    assert len(reqs) == 8819 and abs(reqs[-1].arrival_s - 3436) < 2
