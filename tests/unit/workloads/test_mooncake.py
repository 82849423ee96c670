"""Mooncake JSONL loader: the real conversation trace and malformed lines."""

from __future__ import annotations

import json

import pytest

from pd_plugins.workloads import TraceFormatError, load_mooncake, prompt_token_ids, summary


def line(ts, n_in, n_out, hashes) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": hashes})


def test_real_conversation_trace(mooncake_conv):
    reqs = mooncake_conv
    assert len(reqs) == 12_031
    assert abs(sum(r.input_tokens for r in reqs) / len(reqs) - 12_035) < 1
    assert max(r.input_tokens for r in reqs) == 126_195
    assert reqs[0].arrival_s == 0 and reqs[-1].arrival_s == pytest.approx(3536.999)
    assert [r.request_id for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert min(r.output_tokens for r in reqs) >= 1


def test_real_cacheable_share_matches_the_readme(mooncake_conv):
    """The README's 36.6% counts ALL hash_ids (partial last blocks included); full blocks: 38.2%."""
    s = summary(mooncake_conv)
    assert 0.36 < s["cacheable_share"] < 0.37
    assert 0.38 < s["full_block_cacheable_share"] < 0.385
    assert abs(s["span_s"] - 3537) < 1


def test_shared_hash_prefix_gives_shared_token_prefix(write):
    path = write("t.jsonl", "\n".join([line(0, 2048, 10, [0, 1, 2, 3]),
                                       line(5, 1800, 10, [0, 1, 7, 8]),
                                       line(9, 700, 10, [0, 9])]) + "\n")
    a, b, c = (prompt_token_ids(r) for r in load_mooncake(path))
    assert a[:1024] == b[:1024] and a[1024] != b[1024]  # share exactly k=2 blocks
    assert a[:512] == c[:512] and a[512] != c[512]  # share k=1 block
    assert len(c) == 700


def test_sorts_stably_rebases_and_lifts_zero_outputs(write):
    path = write("t.jsonl", "\n".join([line(2000, 10, 0, [1]), "", line(1500, 20, 3, [2]),
                                       line(2000, 30, 4, [3])]) + "\n\n")
    reqs = load_mooncake(path)
    assert [r.input_tokens for r in reqs] == [20, 10, 30]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 0.5]
    assert [r.request_id for r in reqs] == [0, 1, 2]
    assert reqs[1].output_tokens == 1 and reqs[1].block_hashes == (1,)


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"timestamp": 1, "input_length": 10, "hash_ids": [1]}', "output_length"),
    (line(1, -5, 10, []), "input_length"),
    (line(1, 10, True, [1]), "output_length"),
    (line(1, 10, 10**12, [1]), "output_length 1000000000000 is over 16777216 tokens"),
    (line(-1, 10, 10, [1]), "timestamp"),
    (line(1, 1025, 10, [1, 2]), "has 2 ids, expected"),
    (line(1, 600, 10, [1, "x"]), "hash_ids"),
    (line(1, 600, 10, [1, 2.0]), "hash_ids"),
    (line(1, 600, 10, None), "hash_ids"),
])
def test_bad_lines_name_file_and_line(write, bad, message):
    good = line(0, 600, 10, [1, 2])
    path = write("bad.jsonl", "\n".join([good, "", good, bad, good]) + "\n")  # bad is line 4
    with pytest.raises(TraceFormatError, match=message) as info:
        load_mooncake(path)
    assert str(info.value).startswith(f"{path}:4: ") and info.value.line == 4


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
    good = line(0, 600, 10, [1, 2]) + "\n"
    path = tmp_path / "bin.jsonl"
    path.write_bytes(good.encode() * 2 + b"\x00\xff\xfe" + good.encode())
    with pytest.raises(TraceFormatError, match="not UTF-8") as info:
        load_mooncake(path)
    assert str(info.value).startswith(f"{path}:3: ") and info.value.line == 3
