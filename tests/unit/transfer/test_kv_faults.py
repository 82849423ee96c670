"""KV fault injection (transfer/kv_faults.py): the spec's syntax, refusal without the allow
variable or under production, which requests are hit (`match`, `every`, `limit`), and counting."""

import pytest

from pd_plugins.transfer.kv_faults import (
    ALLOWED_VAR,
    FAULTS_VAR,
    PRODUCTION_VAR,
    FaultRule,
    KvFaults,
    parse,
    position,
    refusal,
)
from pd_plugins.transfer.options import KvFaultOptions, OptionError, from_env, from_extra_config

ALLOWED = {ALLOWED_VAR: "1"}


def test_parse_kinds_and_keys():
    assert parse("flip_slot:match=kvfault-,every=2,limit=50,seed=7; corrupt", "t") == (
        FaultRule("flip_slot", match="kvfault-", every=2, limit=50, seed=7),
        FaultRule("corrupt"))
    assert parse(" ; ", "t") == ()


@pytest.mark.parametrize("spec, why", [
    ("scramble", "fault kind 'scramble' is not one of"),
    ("corrupt:often=2", "'often=2' is not one of"),
    ("corrupt:match", "'match' is not one of"),
    ("corrupt:every=0", "every must be at least 1"),
    ("corrupt:limit=-1", "limit must be non-negative"),
    ("corrupt:seed=x", "seed must be an integer, got 'x'"),
])
def test_parse_refuses_what_it_cannot_take_and_says_why(spec, why):
    with pytest.raises(OptionError, match=why):
        parse(spec, "t")


def test_refused_without_the_allow_variable():
    with pytest.raises(OptionError, match=f"needs {ALLOWED_VAR}=1"):
        KvFaults.from_spec("corrupt", "PdShmConnector", environ={})
    with pytest.raises(OptionError, match=f"needs {ALLOWED_VAR}=1"):
        KvFaults.from_spec("corrupt", "PdShmConnector", environ={ALLOWED_VAR: "0"})


@pytest.mark.parametrize("production", ["1", "true", "yes", "garbled"])
def test_refused_under_production_even_when_allowed(production):
    with pytest.raises(OptionError, match=f"{PRODUCTION_VAR} is set"):
        KvFaults.from_spec("corrupt", "t", environ={ALLOWED_VAR: "1", PRODUCTION_VAR: production})


def test_no_spec_needs_no_permission_and_injects_nothing():
    for spec in (None, "", "  "):
        faults = KvFaults.from_spec(spec, "t", environ={PRODUCTION_VAR: "1"})
        assert not faults.enabled and faults.take("corrupt", "kvfault-1") is None
    assert refusal({PRODUCTION_VAR: "0", ALLOWED_VAR: "1"}) is None


def test_a_bad_spec_is_refused_before_permission_is_looked_at():
    with pytest.raises(OptionError, match="not one of"):
        KvFaults.from_spec("bogus", "t", environ={PRODUCTION_VAR: "1"})


def test_match_every_and_limit_choose_the_requests_and_every_injection_is_counted():
    faults = KvFaults.from_spec("flip_slot:match=kvfault-,every=2,limit=3", "t", ALLOWED)
    hit = [i for i in range(10) if faults.take("flip_slot", f"cmpl-kvfault-{i}-0")]
    assert hit == [0, 2, 4]  # every second match, then the limit
    assert faults.take("flip_slot", "cmpl-other-0") is None
    assert faults.take("corrupt", "cmpl-kvfault-20-0") is None  # another kind: no rule
    assert faults.injected["flip_slot"] == 3 and faults.injected["corrupt"] == 0


def test_each_kind_is_counted_apart():
    faults = KvFaults.from_spec("corrupt;reuse:match=b", "t", ALLOWED)
    assert faults.handles("reuse") and not faults.handles("flip_slot")
    for target in ("a", "b", "ab"):
        faults.take("corrupt", target)
        faults.take("reuse", target)
    assert faults.injected == {"corrupt": 3, "reuse": 2, "drop_write": 0, "stale_chunk": 0,
                               "flip_slot": 0}


def test_position_is_fixed_by_seed_and_target():
    rule = FaultRule("flip_slot", seed=1)
    spots = {position(rule, f"r{i}", 4096) for i in range(50)}
    assert len(spots) > 40 and all(0 <= p < 4096 for p in spots)
    assert position(rule, "r1", 4096) == position(FaultRule("corrupt", seed=1), "r1", 4096)
    assert position(rule, "r1", 1 << 20) != position(FaultRule("flip_slot", seed=2), "r1", 1 << 20)


def test_the_option_comes_from_either_engines_source():
    extra = {"faults": "flip_slot:limit=50", "pool_path": "/dev/shm/x"}
    assert from_extra_config(KvFaultOptions, lambda k, d: extra.get(k, d), "t").faults == (
        "flip_slot:limit=50")
    assert from_env(KvFaultOptions, "t", {FAULTS_VAR: "corrupt"}).faults == "corrupt"
    assert KvFaultOptions().faults is None
