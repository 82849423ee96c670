"""Azure LLM inference 2023 CSV loader: 7-digit timestamps, validation, unique block ids."""

from __future__ import annotations

import pytest

from pd_plugins.workloads import AZURE_ID_BASE, TraceFormatError, blocks_for, load_azure, summary

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_real_conv_trace(azure_conv):
    reqs = azure_conv
    assert len(reqs) == 19_366
    assert abs(reqs[-1].arrival_s - 3502) < 2 and reqs[0].arrival_s == 0
    assert abs(sum(r.input_tokens for r in reqs) / len(reqs) - 1155) < 1
    assert max(r.input_tokens for r in reqs) == 14_050
    assert abs(summary(reqs)["output_mean"] - 211) < 1


def test_real_block_ids_are_unique(azure_conv):
    ids = [h for r in azure_conv for h in r.block_hashes]
    assert len(ids) == len(set(ids)) and min(ids) >= AZURE_ID_BASE
    assert all(len(r.block_hashes) == blocks_for(r.input_tokens) for r in azure_conv)
    assert summary(azure_conv)["cacheable_share"] == 0


def test_seven_digit_timestamps_are_exact(write):
    path = write("t.csv", HEADER + "2023-11-16 18:15:46.6805900,374,44\n"
                                   "2023-11-16 18:15:50.9951690,396,0\n"
                                   "2023-11-16 23:59:59.9999999,1,1\n"
                                   "2023-11-17 00:00:00.0000001,1,1\n"
                                   "2023-11-17 00:00:01,1024,3\n")
    reqs = load_azure(path)
    assert reqs[1].arrival_s == 4_314_579_000 / 1e9 == pytest.approx(4.3145790, abs=1e-12)
    assert reqs[3].arrival_s - reqs[2].arrival_s == pytest.approx(2e-7, abs=1e-9)  # over midnight
    assert reqs[4].arrival_s == pytest.approx(20654.3194100)
    assert reqs[1].output_tokens == 1 and reqs[1].input_tokens == 396
    assert [len(r.block_hashes) for r in reqs] == [1, 1, 1, 1, 2]
    assert reqs[0].block_hashes == (AZURE_ID_BASE,)
    assert reqs[4].block_hashes == (AZURE_ID_BASE + 4, AZURE_ID_BASE + 5)


def test_bad_header_is_line_1(write):
    path = write("h.csv", "TIME,Context,Generated\n2023-11-16 18:15:46.6805900,374,44\n")
    with pytest.raises(TraceFormatError, match="header") as info:
        load_azure(path)
    assert str(info.value).startswith(f"{path}:1: ")


@pytest.mark.parametrize("bad, message", [
    ("2023-11-16T18:15:47.1,10,10", "TIMESTAMP"),
    ("2023-13-16 18:15:47.1,10,10", "TIMESTAMP"),
    ("2023-11-16 18:15:47.1234567890,10,10", "TIMESTAMP"),
    ("2023-11-16 18:15:47.1,ten,10", "ContextTokens"),
    ("2023-11-16 18:15:47.1,10,-3", "GeneratedTokens"),
    ("2023-11-16 18:15:47.1,10", "expected 3 columns"),
    # one short row must not allocate 2e11 block ids
    ("2023-11-16 18:15:47.1,99999999999999,10", "ContextTokens 99999999999999 is over 16777216"),
    ("2023-11-16 18:15:47.1,10,16777217", "GeneratedTokens 16777217 is over"),
    ("2023-11-16 18:15:47.1," + "9" * 5000 + ",10", "ContextTokens 9999"),  # past int()'s digits
])
def test_bad_rows_name_file_and_line(write, bad, message):
    good = "2023-11-16 18:15:46.6805900,374,44\n"
    path = write("b.csv", HEADER + good + "\n" + good + bad + "\n" + good)  # bad is line 5
    with pytest.raises(TraceFormatError, match=message) as info:
        load_azure(path)
    assert str(info.value).startswith(f"{path}:5: ") and info.value.line == 5


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
    path = tmp_path / "latin1.csv"
    good = "2023-11-16 18:15:46.6805900,374,44\n"
    path.write_bytes((HEADER + good).encode() + b"2023-11-16 18:15:47.0,1\xe90,10\n")
    with pytest.raises(TraceFormatError, match="not UTF-8") as info:
        load_azure(path)
    assert str(info.value).startswith(f"{path}:3: ") and info.value.line == 3
    path.write_bytes(b"TIME\xa7STAMP,ContextTokens,GeneratedTokens\n" + good.encode())
    with pytest.raises(TraceFormatError, match="not UTF-8") as info:
        load_azure(path)
    assert info.value.line == 1
