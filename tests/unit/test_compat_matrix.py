"""docs/connectors.md's compatibility matrix is the rendering of tests/e2e/compat_matrix.py, and
every cell it calls tested or refused names a test that exists."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.compat_matrix import CELLS, CI, COLUMNS, FULL, ROWS, with_matrix

ROOT = Path(__file__).resolve().parents[2]


def test_docs_matrix_is_rendered_from_the_cells():
    doc = (ROOT / "docs" / "connectors.md").read_text(encoding="utf-8")
    assert with_matrix(doc) == doc, (
        "docs/connectors.md's compatibility matrix is out of date: run "
        "`.venv/bin/python -m tests.e2e.compat_matrix --update docs/connectors.md`")


def test_every_position_has_one_cell_and_every_claim_a_test():
    positions = [(cell.row, cell.column) for cell in CELLS]
    assert sorted(positions) == sorted((r, c) for r in ROWS for c in COLUMNS)
    for cell in CELLS:
        if cell.status in (CI, FULL) or cell.status.startswith("refused at startup"):
            assert cell.test, f"{cell.row} {cell.column}: '{cell.status}' without a test"
        if cell.test:
            path, _, name = cell.test.partition("::")
            source = (ROOT / path).read_text(encoding="utf-8")
            assert f"def {name}(" in source, f"{cell.test} does not exist"
