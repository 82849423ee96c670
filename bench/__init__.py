"""Benchmarks, run from the repository root as modules: `.venv/bin/python -m bench.<name>`
(docs/benchmarks.md, docs/development.md). The `*_plot` modules run in bench/.venv-peers."""
