"""bench/kv_verify.py's pure parts: the paired on/off summary, ms per GB and the 2 % verdict."""

from __future__ import annotations

import pytest

from bench import kv_verify as kv

MIB_BLOCK = kv.kvt.KV_BYTES_PER_BLOCK / 1e9  # GB in one kv-llama block


def row(rnd, verify, decode_s, prefill_s=1.0, blocks=14, length=448, **extra):
    out = {"round": rnd, "length": length, "verify": verify, "decode_s": decode_s,
           "prefill_s": prefill_s, "verdict": "verified" if verify == "on" else None,
           "verified_blocks": blocks if verify == "on" else 0, **extra}
    return out


def test_overhead_is_paired_per_round_not_a_ratio_of_medians():
    # the host slows down over the run; each round's on is 1 % slower than its own off
    rows = []
    for r, base in enumerate((0.050, 0.100, 0.200, 0.400, 0.800)):
        rows += [row(r, "off", base), row(r, "on", base * 1.01)]
    paired = kv.summarise({"rows": rows})[448]["paired"]
    assert paired["rounds"] == 5
    assert paired["decode_overhead"]["p50"] == pytest.approx(0.01)
    assert paired["decode_overhead"]["p10"] == pytest.approx(0.01)
    assert paired["goal_met"] is True
    # the extra decode time per GB: 1 % of the middle round's 200 ms over 14 MiB
    assert paired["ms_per_gb_decode_s"]["p50"] == pytest.approx(2.0 / (14 * MIB_BLOCK))
    assert paired["verified_gb"] == pytest.approx(14 * MIB_BLOCK)


def test_a_failed_request_drops_its_round_from_the_pairs_and_is_counted():
    rows = [row(0, "off", 0.05), row(0, "on", 0.06),
            row(1, "off", 0.05), {**row(1, "on", 9.0), "failed": 500},
            row(2, "off", 0.05), row(2, "on", 0.06)]
    s = kv.summarise({"rows": rows})[448]
    assert s["paired"]["rounds"] == 2
    assert s["on"]["failed"] == 1 and s["off"]["failed"] == 0
    assert s["paired"]["decode_overhead"]["p50"] == pytest.approx(0.2)
    assert s["paired"]["goal_met"] is False


def test_copy_counters_give_ms_per_gb_of_the_sums():
    rows = [row(0, "off", 0.05, store_s=0.002, load_s=0.003),
            row(0, "on", 0.05, store_s=0.003, load_s=0.004)]
    paired = kv.summarise({"rows": rows})[448]["paired"]
    assert paired["ms_per_gb_copies"]["p50"] == pytest.approx(2.0 / (14 * MIB_BLOCK))


def test_verdict_words():
    met = kv.summarise({"rows": [row(r, v, 0.05 * (1.01 if v == "on" else 1))
                                 for r in range(3) for v in ("off", "on")]})
    assert kv.verdict_of(met) == "met"
    unverified = kv.summarise({"rows": [row(r, v, 0.05, blocks=0) for r in range(3)
                                        for v in ("off", "on")]})
    assert kv.verdict_of(unverified).startswith("nothing verified")
    assert "ms_per_gb_decode_s" not in unverified[448]["paired"]
    noisy = kv.summarise({"rows": [row(r, v, 0.05 * ((1.0 + d) if v == "on" else 1))
                                   for r, d in enumerate((-0.2, -0.1, 0.03, 0.1, 0.2))
                                   for v in ("off", "on")]})
    assert kv.verdict_of(noisy).startswith("not resolved (the median says not met, but 2 % lies")


def test_every_transport_has_a_line_in_the_section_even_unrun():
    text = kv.markdown({})
    assert text.startswith("<!-- kv-verify:start -->") and text.rstrip().endswith(
        "<!-- kv-verify:end -->")
    for transport in kv.TRANSPORTS.values():
        assert f"- {transport.name}: **not run yet**" in text


def test_digest_share_is_the_counted_time_over_the_on_pairs_legs():
    from bench.kv_verify import TIME_COUNTERS, digest_share

    seconds, nbytes = TIME_COUNTERS
    rows = [{"verify": "on", "decode_s": 0.5, "prefill_s": 1.0},
            {"verify": "on", "decode_s": 0.5, "prefill_s": 1.0},
            {"verify": "on", "failed": 500, "decode_s": 9.0, "prefill_s": 9.0},  # not counted
            {"verify": "off", "decode_s": 0.4, "prefill_s": 1.0}]
    run = {"rows": rows, "digest": {"on": {"decode": {seconds: 0.01, nbytes: 2e9},
                                           "prefill": {seconds: 0.04, nbytes: 2e9}}}}
    share = digest_share(run)
    assert share["decode"] == {"ms_per_request": 5.0, "share": 0.01, "ms_per_gb": 5.0}
    assert share["prefill"]["share"] == 0.02 and share["prefill"]["ms_per_gb"] == 20.0
    assert digest_share({"rows": rows}) is None  # a run saved before the counters existed
