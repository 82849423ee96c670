"""Workloads for routing benchmarks: public traces (Mooncake, Azure) and a conversation generator,
all as lists of `TraceRequest` (arrival, lengths, chained prefix-block ids).

    reqs = load_trace("mooncake_conv")            # a TRACES name or a .jsonl / .csv path
    reqs = slice_window(scale_time(reqs, 2.0), 0, 600)
    prompt = prompt_token_ids(reqs[0])            # token ids whose prefixes match the block ids

Trace files live outside the repository, in `shared/traces` next to (or above) it; set
PD_TRACES_DIR to point elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from pd_plugins.workloads.azure import AZURE_ID_BASE, load_azure
from pd_plugins.workloads.conversations import ConversationSpec, block_id, generate_conversations
from pd_plugins.workloads.mooncake import load_mooncake
from pd_plugins.workloads.trace import (HASH_BLOCK_SIZE, TraceFormatError, TraceRequest,
                                        blocks_for, first_n, prompt_token_ids, scale_time,
                                        slice_window, spread_bursts, summary)

__all__ = [
    "AZURE_ID_BASE", "HASH_BLOCK_SIZE", "TRACES", "ConversationSpec", "TraceFormatError",
    "TraceRequest", "block_id", "blocks_for", "first_n", "generate_conversations", "load_azure",
    "load_mooncake", "load_trace", "prompt_token_ids", "scale_time", "slice_window", "spread_bursts", "summary",
    "traces_dir",
]

_TRACE_FILES = {
    "mooncake_conv": "mooncake/conversation_trace.jsonl",
    "azure_conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "azure_code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
}


def traces_dir() -> Path:
    """$PD_TRACES_DIR, else the first `shared/traces` found walking up from this file (the repo's
    sibling `../shared/traces` included); FileNotFoundError if there is none."""
    env = os.environ.get("PD_TRACES_DIR")
    if env:
        if not Path(env).is_dir():
            raise FileNotFoundError(f"PD_TRACES_DIR={env} is not a directory")
        return Path(env)
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "traces").is_dir():
            return parent / "shared" / "traces"
    raise FileNotFoundError("no shared/traces directory above pd_plugins/workloads; "
                            "set PD_TRACES_DIR to the folder holding the trace files")


class _TraceFiles(Mapping[str, Path]):
    """Name -> path of the known trace files, resolved on access so that importing this package
    never fails when the traces are absent, and PD_TRACES_DIR can change at run time."""

    def __getitem__(self, name: str) -> Path:
        return traces_dir() / _TRACE_FILES[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_TRACE_FILES)

    def __len__(self) -> int:
        return len(_TRACE_FILES)


TRACES: Mapping[str, Path] = _TraceFiles()


def load_trace(path_or_name: str | os.PathLike) -> list[TraceRequest]:
    """Load a TRACES name or a file, picking the loader by suffix (.jsonl Mooncake, .csv Azure)."""
    if isinstance(path_or_name, str) and path_or_name in _TRACE_FILES:
        path = TRACES[path_or_name]
    else:
        path = Path(path_or_name)
    if path.suffix == ".jsonl":
        return load_mooncake(path)
    if path.suffix == ".csv":
        return load_azure(path)
    raise ValueError(f"unknown trace {path_or_name!r}: expected one of {sorted(_TRACE_FILES)} "
                     "or a .jsonl (Mooncake) / .csv (Azure) file")
