"""workloads/traffic_record.py: pd-router's traffic record read back as TraceRequests."""

from __future__ import annotations

import json

import pytest

from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.hardware import preset
from pd_plugins.routers.config import TrafficRecordSpec
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.traffic_record import Measured, TrafficRecorder
from pd_plugins.workloads import ConversationSpec, generate_conversations, prompt_token_ids
from pd_plugins.workloads.trace import TraceFormatError
from pd_plugins.workloads.traffic_record import load_traffic_record
from pd_plugins.vocab.block_keys import block_keys


def line(**over) -> str:
    rec = {"t": 100.0, "model": "m", "input_tokens": 40, "output_tokens": 5, "block_keys": [7, 8],
           "block_size": 16, "session": None, "turn": None, "decision": "local", "prefill": None,
           "decode": "http://d", "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 0.2, "status": 200}
    return json.dumps({**rec, **over}) + "\n"


def write(tmp_path, *lines: str):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(lines))
    return path


def test_records_become_requests_in_arrival_order(tmp_path):
    path = write(tmp_path, line(t=105.5, input_tokens=100, block_keys=[1, 2, 3], session="s", turn=1),
                 line(t=100.0), "\n", line(t=103.0, decision="rejected", output_tokens=0, status=429))
    a, b, c = load_traffic_record(path)
    assert [r.request_id for r in (a, b, c)] == [0, 1, 2]
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 3.0, 5.5]
    assert a.input_tokens == 40 and a.output_tokens == 5 and a.block_tokens == 16
    assert a.block_hashes[:2] == (7, 8) and len(a.block_hashes) == 3  # 2 full + 1 partial
    assert b.output_tokens == 1  # an engine emits a token at least
    assert c.session_id == "s" and c.turn == 1 and len(c.block_hashes) == 7
    assert c.block_hashes[:3] == (1, 2, 3) and len(set(c.block_hashes[3:]) & set(a.block_hashes)) == 0
    assert len(load_traffic_record(path, include_unserved=False)) == 2


def test_models_and_block_sizes_are_kept_apart(tmp_path):
    path = write(tmp_path, line(model="a"), line(model="b", block_size=32, block_keys=[1]))
    with pytest.raises(ValueError, match="several models"):
        load_traffic_record(path)
    assert [r.block_tokens for r in load_traffic_record(path, model="b")] == [32]


@pytest.mark.parametrize("bad, what", [
    ("{not json", "not valid JSON"),
    ("[1]", "expected a JSON object"),
    (line(t=-1), "t must be"),
    (line(input_tokens="many"), "input_tokens must be"),
    # one short line must not allocate 6e9 block ids (or simulate 1e11 steps)
    (line(input_tokens=10**11, block_keys=[]), "input_tokens 100000000000 is over 16777216"),
    (line(output_tokens=2**24 + 1), "output_tokens 16777217 is over 16777216"),
    (line(block_keys=[1, 2, 3]), "more than its full blocks"),
    (line(block_keys=["x"]), "block_keys must be a list of ints"),
    (line(block_size=0), "block_size must be"),
    (line(decision="maybe"), "decision must be one of"),
    (json.dumps({"t": 1}), "missing key"),
])
def test_bad_lines_name_file_and_line(tmp_path, bad, what):
    path = write(tmp_path, line(), bad + "\n")
    with pytest.raises(TraceFormatError, match=what) as info:
        load_traffic_record(path)
    assert info.value.line == 2


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    cafe = line().replace('"m"', '"caf\u00e9"')  # a model name written as Latin-1
    path.write_bytes((line() * 2).encode() + cafe.encode("latin-1"))
    with pytest.raises(TraceFormatError, match="not UTF-8") as info:
        load_traffic_record(path)
    assert str(info.value).startswith(f"{path}:3: ") and info.value.line == 3
    path.write_bytes(cafe.encode("utf-8"))  # UTF-8 itself is fine
    assert [r.input_tokens for r in load_traffic_record(path)] == [40]


def test_a_record_of_n_requests_round_trips_and_simulates(tmp_path):
    """The router's writer, fed what it would compute for a generated workload, read back: the
    same tokens, arrivals, sessions and prefix sharing; the simulator runs it."""
    spec = ConversationSpec(session_rate_per_s=1.0, mean_turns=3, max_turns=4, block_tokens=16,
                            user_tokens_median=200, user_tokens_range=(20, 800),
                            assistant_tokens_median=40, assistant_tokens_range=(5, 100),
                            shared_system_tokens=64, think_time_median_s=2.0)
    workload = generate_conversations(spec, 12, seed=5)
    path = tmp_path / "r.jsonl"
    recorder = TrafficRecorder(TrafficRecordSpec(path=str(path)))
    recorder.start()
    for r in workload:
        keys = block_keys(prompt_token_ids(r), 16)  # the router's own keys of the prompt
        info = RequestInfo(prompt_tokens=r.input_tokens, block_keys=keys, session_id=r.session_id,
                           max_tokens=r.output_tokens, turn=r.turn)
        recorder.record("m", info, 16, Measured(1_700_000_000 + r.arrival_s, decision="local",
                                                output_tokens=r.output_tokens), 200, r.turn)
    recorder.close()
    back = load_traffic_record(path)
    assert len(back) == len(workload) > 12
    for orig, got in zip(workload, back):
        assert (got.input_tokens, got.output_tokens, got.session_id, got.turn) == \
               (orig.input_tokens, orig.output_tokens, orig.session_id, orig.turn)
        assert got.arrival_s == pytest.approx(orig.arrival_s - workload[0].arrival_s, abs=1e-5)
    # prefix sharing survives: two requests share k full blocks in one iff in the other
    for i in range(0, len(back), 3):
        for j in range(i + 1, len(back), 2):
            def shared(a, b):
                n = 0
                for x, y in zip(a.full_block_hashes(), b.full_block_hashes()):
                    if x != y:
                        break
                    n += 1
                return n
            assert shared(back[i], back[j]) == shared(workload[i], workload[j])
    result = simulate(back, SimConfig(preset("llama-3.1-8b@h100"), 2, 2, block_tokens=16,
                                      policy="prefix_cache"))
    assert [o.status for o in result.outcomes] == ["ok"] * len(back)
    assert result.prompt_tokens_cached > 0  # the shared system prompt and the earlier turns
