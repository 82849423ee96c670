import pytest

from pd_plugins.connectors.transfer_params import lease_check_of, malformed_params_error, remote_prefill_error
from pd_plugins.vocab.transfer_params import PdSection, pd_section_of

GOOD_PULL = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-abc-0-1234abcd",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_block_ids": [[1, 2, 3]],
    "tp_size": 1,
    "remote_num_tokens": 80,
}


def test_well_formed_pull_params_pass():
    assert remote_prefill_error(GOOD_PULL, "pull") is None
    assert remote_prefill_error({**GOOD_PULL, "remote_block_ids": [4, 5]}, "pull") is None


def test_push_params_need_no_block_ids():
    push = {k: v for k, v in GOOD_PULL.items() if k != "remote_block_ids"}
    assert remote_prefill_error(push, "push") is None
    assert "remote_block_ids is missing" in remote_prefill_error(push, "pull")


def test_requests_without_remote_prefill_are_not_checked():
    assert remote_prefill_error({"do_remote_decode": True}, "pull") is None
    assert remote_prefill_error({"do_remote_prefill": False, "remote_port": "x"}, "pull") is None


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("remote_port", "5600", "remote_port must be a port number"),
        ("remote_port", 70000, "remote_port must be a port number"),
        ("remote_port", True, "remote_port must be a port number"),
        ("remote_engine_id", "", "remote_engine_id must be a non-empty string"),
        ("remote_engine_id", 7, "remote_engine_id must be a non-empty string"),
        ("remote_block_ids", "1,2", "remote_block_ids must be a list"),
        ("remote_block_ids", [[1, -2]], "remote_block_ids must be a list"),
        ("remote_block_ids", [1, [2]], "remote_block_ids must be a list"),
        ("tp_size", 0, "tp_size must be a positive integer"),
        ("remote_num_tokens", -1, "remote_num_tokens must be a non-negative integer"),
        ("pp_size", 0, "pp_size must be a positive integer"),
        ("dcp_size", "2", "dcp_size must be a positive integer"),
        ("remote_block_size", [16], "remote_block_size must be a positive integer"),
        ("remote_blocks_expiry_time", "soon", "remote_blocks_expiry_time must be a number"),
        ("remote_blocks_expiry_time", float("nan"), "remote_blocks_expiry_time must be a number"),
    ],
)
def test_wrong_types_are_named(field, value, words):
    error = remote_prefill_error({**GOOD_PULL, field: value}, "pull")
    assert error is not None and words in error


@pytest.mark.parametrize("field", ["remote_engine_id", "remote_request_id", "remote_host",
                                   "remote_port", "tp_size"])
def test_missing_fields_are_named(field):
    params = {k: v for k, v in GOOD_PULL.items() if k != field}
    assert remote_prefill_error(params, "push") == f"kv_transfer_params.{field} is missing"


def test_pd_section_round_trip():
    section = PdSection(prompt_tokens=80, cached_tokens=64, engine_id="p0", mode="pull",
                        block_size=32)
    import msgspec

    params = {**GOOD_PULL, "pd": msgspec.to_builtins(section)}
    assert pd_section_of(params) == section
    assert pd_section_of(GOOD_PULL) is None
    assert pd_section_of(None) is None


def test_lease_check_endpoint_comes_from_the_pd_section():
    params = {**GOOD_PULL, "pd": {"lease_check_port": 5700}}
    assert lease_check_of(params) == ("127.0.0.1", 5700, "cmpl-abc-0-1234abcd")


@pytest.mark.parametrize("pd", [None, {}, {"lease_check_port": None}, {"lease_check_port": "5700"},
                                {"lease_check_port": 0}, {"lease_check_port": 70000}, "x"])
def test_no_usable_lease_check_port_means_unchecked(pd):
    params = dict(GOOD_PULL) if pd is None else {**GOOD_PULL, "pd": pd}
    assert lease_check_of(params) is None


@pytest.mark.parametrize("value", ["", 0, 0.0, [], "x", 7, [1, "a"], True])
def test_params_that_are_not_an_object_are_named(value):
    error = malformed_params_error(value)
    assert error is not None and "must be a JSON object" in error


def test_absent_or_object_params_are_readable():
    assert malformed_params_error(None) is None
    assert malformed_params_error({}) is None
    assert malformed_params_error(GOOD_PULL) is None
    assert remote_prefill_error({**GOOD_PULL, "remote_blocks_expiry_time": 1.7e9}, "pull") is None
