"""Load outcomes and verdicts (connectors/vllm/kv_verdicts.py, vocab KvVerdict): which verdict a
request gets, how ranks' and repeated loads' outcomes merge, the bound on what is kept, and the
`pd.kv` wire form."""

import pytest

from pd_plugins.connectors.vllm import kv_verdicts
from pd_plugins.connectors.vllm.kv_verdicts import KvLoadOutcomes, LoadOutcome, VerdictBook
from pd_plugins.vocab.transfer_params import KvVerdict, kv_verdict_of, pd_section_of


def book(recompute=True):
    return VerdictBook("shm", recompute=recompute)


def reported(**outcomes: LoadOutcome) -> KvLoadOutcomes:
    meta = KvLoadOutcomes()
    for req_id, outcome in outcomes.items():
        meta.record(req_id, outcome)
    return meta


@pytest.mark.parametrize("outcome, errored, recompute, word", [
    (LoadOutcome(4, 0, 0, True), False, True, "verified"),
    (LoadOutcome(4, 0, 0, False), False, True, "unverified"),
    (LoadOutcome(4, 2, 1, True), False, True, "recomputed"),
    (LoadOutcome(4, 1, 0, True), False, True, "recomputed"),  # gone, not mismatched
    (LoadOutcome(4, 2, 1, True), False, False, "failed"),
    (LoadOutcome(4, 0, 0, True), True, True, "failed"),
])
def test_the_verdict_of_a_reported_load(outcome, errored, recompute, word):
    verdicts = book(recompute)
    verdicts.expect("r", 4, checked=True)
    verdicts.record(reported(r=outcome))
    assert verdicts.verdict("r", errored) == KvVerdict(
        verdict=word, blocks=4, mismatched=outcome.mismatched, transport="shm")
    assert verdicts.verdict("r", errored) is None  # forgotten once answered


def test_a_request_that_finished_in_its_load_step_gets_the_clean_verdict():
    verdicts = book()
    verdicts.expect("checked", 3, checked=True)
    verdicts.expect("unchecked", 3, checked=False)
    assert verdicts.verdict("checked", False).verdict == "verified"
    assert verdicts.verdict("unchecked", False).verdict == "unverified"
    verdicts.expect("errored", 3, checked=True)
    assert verdicts.verdict("errored", True).verdict == "failed"


def test_no_load_no_verdict_and_unknown_reports_are_ignored():
    verdicts = book()
    verdicts.record(reported(stranger=LoadOutcome(1, 1, 1, True)))
    verdicts.record(object())  # another connector's metadata
    assert verdicts.verdict("stranger", False) is None


def test_ranks_and_repeated_loads_merge_worst_first():
    meta = reported(r=LoadOutcome(4, 0, 0, True))
    meta.aggregate(reported(r=LoadOutcome(4, 2, 2, True), s=LoadOutcome(1, 0, 0, False)))
    assert meta.outcomes == {"r": LoadOutcome(4, 2, 2, True), "s": LoadOutcome(1, 0, 0, False)}
    verdicts = book()
    verdicts.expect("r", 4, checked=True)
    verdicts.record(meta)
    verdicts.expect("r", 4, checked=True)  # preempted and loaded again: the bad load stays
    verdicts.record(reported(r=LoadOutcome(4, 0, 0, True)))
    assert verdicts.verdict("r", False).verdict == "recomputed"


def test_the_book_is_bounded(monkeypatch):
    monkeypatch.setattr(kv_verdicts, "MAX_PENDING", 3)
    verdicts = book()
    for i in range(5):
        verdicts.expect(f"r{i}", 1, checked=True)
    assert verdicts.verdict("r0", False) is None and verdicts.verdict("r1", False) is None
    assert verdicts.verdict("r4", False).verdict == "verified"


def test_pd_kv_wire_form():
    verdict = KvVerdict(verdict="recomputed", blocks=3, mismatched=1, transport="shm")
    params = verdict.into(None)
    assert params == {"pd": {"kv": {"verdict": "recomputed", "blocks": 3, "mismatched": 1,
                                    "transport": "shm"}}}
    assert kv_verdict_of(params) == verdict
    # beside a prefill's pd section, which still parses
    prefill = {"pd": {"prompt_tokens": 4, "cached_tokens": 0, "engine_id": "p", "mode": "shm",
                      "block_size": 16}, "pool_id": "x"}
    both = verdict.into(prefill)
    assert kv_verdict_of(both) == verdict and pd_section_of(both).engine_id == "p"
    assert "kv" not in prefill["pd"]  # the given params are not changed
    assert kv_verdict_of({"pd": {}}) is None and kv_verdict_of(None) is None


@pytest.mark.parametrize("kv", [{"verdict": "fine", "blocks": 1, "mismatched": 0,
                                 "transport": "shm"}, {"verdict": "verified"}, "verified"])
def test_a_malformed_verdict_is_a_value_error(kv):
    with pytest.raises(ValueError, match="malformed pd.kv"):
        kv_verdict_of({"pd": {"kv": kv}})
