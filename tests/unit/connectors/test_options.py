"""Connector options (transfer/options.py): one struct per transport, read from vLLM's
kv_connector_extra_config or from SGLang's PD_* variables, checked the same way; the table in
docs/connectors.md generated from them."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from pd_plugins.connectors.vllm.options import extra_flag, extra_options, truthy
from pd_plugins.transfer.options import (
    UNSET,
    HostEnvironment,
    LMCacheOptions,
    NixlOptions,
    OptionError,
    ShmOptions,
    documented_variables,
    fields,
    from_env,
    from_extra_config,
    with_table,
)

ROOT = Path(__file__).resolve().parents[3]
TRANSPORTS = (NixlOptions, ShmOptions, LMCacheOptions)


def vllm_config(extra):
    """A kv_transfer_config as the connectors see it (only get_from_extra_config is used)."""
    return SimpleNamespace(get_from_extra_config=lambda name, default: extra.get(name, default))


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), ("true", True), ("1", True), ("on", True),
    ("false", False), ("False", False), (" no ", False), ("0", False), ("off", False), (0, False),
    (1, True), ("", False),
])
def test_truthy(value, expected):
    assert truthy(value) is expected


def test_a_word_that_is_no_flag_is_refused():
    with pytest.raises(ValueError, match="expected a flag"):
        truthy("banana")  # it was on before: any unknown string was


def test_extra_flag_default_and_string_false():
    extra = {"expert_signatures": "false"}
    config = SimpleNamespace(get_from_extra_config=lambda name, default: extra.get(name, default))
    assert extra_flag(config, "expert_signatures") is False  # bool("false") would be True
    assert extra_flag(config, "keep_cpu_affinity", True) is True
    assert extra_flag(config, "other") is False
    with pytest.raises(ValueError, match="kv_connector_extra_config.expert_signatures"):
        extra_flag(vllm_config({"expert_signatures": "maybe"}), "expert_signatures")


# -- from kv_connector_extra_config (vLLM) -----------------------------------------------------
def test_nixl_from_extra_config():
    options = extra_options(NixlOptions, vllm_config({
        "mode": "push", "kv_lease_duration": "45", "lease_check_port": 7000,
        "keep_cpu_affinity": "false", "transfer_threads_nice": None,
        "backends": ["UCX"]}), "PdNixlConnector")  # upstream's own keys are left alone
    assert (options.mode, options.kv_lease_duration, options.lease_check_port) == ("push", 45, 7000)
    assert options.push_timeout == 60.0  # lease + 15 unless set
    assert options.keep_cpu_affinity is False
    assert options.nice_on(cpu_engine=True) is None  # null: leave the threads alone
    default = extra_options(NixlOptions, vllm_config({}), "PdNixlConnector")
    assert default.nice_on(cpu_engine=True) == 19 and default.nice_on(cpu_engine=False) is None
    assert extra_options(NixlOptions, None, "PdNixlConnector") == default  # no kv_transfer_config


def test_shm_from_extra_config():
    options = extra_options(ShmOptions, vllm_config({
        "pool_path": "/dev/shm/p", "pool_size_gb": 0.5, "hold_s": 10, "save_mode": "step",
        "checksums": True, "store": "all", "remove_when_unused": "1", "pool_group": "kv"}),
        "PdShmConnector")
    assert (options.pool_path, options.pool_size_bytes, options.hold_s) == ("/dev/shm/p", 2**29, 10)
    assert (options.save_mode, options.checksums, options.store) == ("step", True, "all")
    assert options.remove_when_unused is True and options.pool_group == "kv"


def test_lmcache_from_extra_config():
    options = extra_options(LMCacheOptions, vllm_config({
        "backend": "fs:///srv/kv", "chunk_size": "64", "lookup": False}), "PdLMCacheConnector")
    assert (options.backend, options.chunk_size, options.lookup) == ("fs:///srv/kv", 64, False)
    assert options.shared
    assert not extra_options(LMCacheOptions, vllm_config({"backend": "cpu"}), "x").shared


# -- from the environment (SGLang) -------------------------------------------------------------
def test_nixl_from_env():
    options = from_env(NixlOptions, "pd-nixl", {
        "PD_NIXL_MODE": " Push ", "PD_NIXL_LEASE_S": "12", "PD_TRANSFER_THREADS_NICE": "none"})
    assert (options.mode, options.kv_lease_duration) == ("push", 12.0)
    assert options.nice_on(cpu_engine=True) is None
    assert from_env(NixlOptions, "pd-nixl", {"PD_TRANSFER_THREADS_NICE": "5"}).nice_on(False) == 5


def test_shm_from_env():
    options = from_env(ShmOptions, "pd-shm", {
        "PD_SHM_POOL": "/dev/shm/x", "PD_SHM_POOL_GB": "0.25", "PD_SHM_HOLD_S": "30",
        "PD_SHM_POOL_GROUP": "", "PD_SHM_REMOVE_WHEN_UNUSED": "true",
        "PD_SHM_SAVE_MODE": "step"})  # not a variable: save_mode is vLLM's only
    assert (options.pool_path, options.pool_size_bytes, options.hold_s) == ("/dev/shm/x", 2**28, 30)
    assert options.pool_group is None and options.remove_when_unused is True
    assert options.save_mode == "layer"


def test_host_environment_from_env():
    env = from_env(HostEnvironment, "pd-plugins", {
        "PD_PEER_SECRET_FILE": "/etc/pd/secret", "PD_PEER_SECRET": "", "PD_PRIVATE_DIR": "/run/pd",
        "PD_BOOTSTRAP_HOST": "127.0.0.1"})
    assert env == HostEnvironment(peer_secret_file="/etc/pd/secret", peer_secret=None,
                                  private_dir="/run/pd", bootstrap_host="127.0.0.1")


# -- bad values are refused, naming the option -------------------------------------------------
@pytest.mark.parametrize("cls, key, value, message", [
    (NixlOptions, "mode", "pul", "kv_connector_extra_config.mode must be one of pull, push, "
                                 "got 'pul'"),
    (NixlOptions, "kv_lease_duration", 0, "kv_connector_extra_config.kv_lease_duration: "),
    (NixlOptions, "push_timeout_s", "soon", "kv_connector_extra_config.push_timeout_s: "),
    (NixlOptions, "lease_check_port", 70000, "kv_connector_extra_config.lease_check_port: "),
    (NixlOptions, "transfer_threads_nice", 40, "kv_connector_extra_config.transfer_threads_nice"),
    (NixlOptions, "keep_cpu_affinity", "maybe", "kv_connector_extra_config.keep_cpu_affinity: "),
    (ShmOptions, "pool_size_gb", 0, "kv_connector_extra_config.pool_size_gb: "),
    (ShmOptions, "hold_s", -1, "kv_connector_extra_config.hold_s: "),
    (ShmOptions, "read_lease_s", 0, "kv_connector_extra_config.read_lease_s: "),
    (ShmOptions, "save_mode", "eventually", "kv_connector_extra_config.save_mode must be one of "
                                            "layer, step"),
    (ShmOptions, "store", "some", "kv_connector_extra_config.store must be one of all, pd"),
    (LMCacheOptions, "chunk_size", -1, "kv_connector_extra_config.chunk_size: "),
    (LMCacheOptions, "timeout_s", "long", "kv_connector_extra_config.timeout_s: "),
    (LMCacheOptions, "local_cpu_gb", 0, "kv_connector_extra_config.local_cpu_gb: "),
    # infinity passes "> 0" (vLLM's JSON takes Infinity): an infinite lease never frees the KV
    # nobody claims, an infinite pool or timeout overflowed at startup without saying what to set
    (NixlOptions, "kv_lease_duration", float("inf"), "kv_connector_extra_config.kv_lease_duration"),
    (NixlOptions, "kv_lease_duration", 1, "kv_connector_extra_config.kv_lease_duration"),
    (NixlOptions, "push_timeout_s", float("inf"), "kv_connector_extra_config.push_timeout_s"),
    (ShmOptions, "pool_size_gb", float("inf"), "kv_connector_extra_config.pool_size_gb"),
    (ShmOptions, "hold_s", float("inf"), "kv_connector_extra_config.hold_s"),
    (LMCacheOptions, "timeout_s", float("inf"), "kv_connector_extra_config.timeout_s"),
])
def test_bad_extra_config_value_names_the_option(cls, key, value, message):
    extra = {"backend": "cpu", key: value} if cls is LMCacheOptions else {key: value}
    with pytest.raises(OptionError, match=re.escape(f"Connector: {message}")):
        extra_options(cls, vllm_config(extra), "Connector")


@pytest.mark.parametrize("cls, variable, value, message", [
    (NixlOptions, "PD_NIXL_MODE", "pul", "PD_NIXL_MODE must be one of pull, push, got 'pul'"),
    (NixlOptions, "PD_NIXL_LEASE_S", "a while", "PD_NIXL_LEASE_S: Expected `float`"),
    (NixlOptions, "PD_TRANSFER_THREADS_NICE", "low", "PD_TRANSFER_THREADS_NICE: "),
    (ShmOptions, "PD_SHM_POOL_GB", "-1", "PD_SHM_POOL_GB: Expected `float` > 0.0"),
    (ShmOptions, "PD_SHM_HOLD_S", "1m", "PD_SHM_HOLD_S: Expected `float`"),
    (ShmOptions, "PD_SHM_REMOVE_WHEN_UNUSED", "please", "PD_SHM_REMOVE_WHEN_UNUSED: expected a "
                                                        "flag"),
])
def test_bad_variable_names_the_variable(cls, variable, value, message):
    with pytest.raises(OptionError, match=re.escape(f"backend: {message}")):
        from_env(cls, "backend", {variable: value})


# -- defaults agree across engines -------------------------------------------------------------
@pytest.mark.parametrize("cls", [NixlOptions, ShmOptions])
def test_defaults_are_the_same_from_either_source(cls):
    assert from_extra_config(cls, vllm_config({}).get_from_extra_config, "vllm") == \
        from_env(cls, "sglang", {})
    assert any(f.env for f in fields(cls))  # both engines have this transport


def test_defaults_that_used_to_differ_between_engines():
    shm = ShmOptions()
    assert (shm.pool_size_gb, shm.hold_s) == (2.0, 60.0)  # SGLang had 1 GB, vLLM a 30 s hold
    nixl = NixlOptions()
    assert nixl.kv_lease_duration == 30.0 and nixl.mode == "pull"


def test_lmcache_backend_has_no_default_and_the_error_says_which_to_pick():
    with pytest.raises(OptionError, match="backend is required") as error:
        extra_options(LMCacheOptions, vllm_config({"store": "all"}), "PdLMCacheConnector")
    for backend in ("fs:///", "mp://", "redis://", "lm://", "`cpu`"):
        assert backend in str(error.value)


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_pd_lmcache_with_only_its_name_and_role_refuses_to_start(kv_role):
    """A PD pair configured with only kv_connector and kv_role used to run on each engine's own
    `cpu` pool, answer correctly and move no KV; now neither engine starts."""
    pytest.importorskip("lmcache")
    from tests.unit.connectors.vllm_scheduler import make_scheduler

    with pytest.raises(OptionError, match="PdLMCacheConnector: kv_connector_extra_config.backend "
                                          "is required: .*fs:///DIR"):
        make_scheduler("PdLMCacheConnector", kv_role)


# -- the table in docs/connectors.md -----------------------------------------------------------
def test_docs_table_is_generated_from_the_structs():
    doc = (ROOT / "docs" / "connectors.md").read_text(encoding="utf-8")
    assert with_table(doc) == doc, (
        "docs/connectors.md's options table is out of date: run "
        "`python -m pd_plugins.transfer.options --update docs/connectors.md`")


def test_every_pd_variable_the_package_reads_is_in_the_table():
    read = re.compile(r"""(?:environ\.get\(|environ\[|getenv\(|setenv\()\s*["'](PD_[A-Z0-9_]+)""")
    found = {name for path in (ROOT / "pd_plugins").rglob("*.py")
             for name in read.findall(path.read_text(encoding="utf-8"))}
    assert found, "the scan finds nothing: the pattern is wrong"
    undocumented = found - documented_variables()
    assert not undocumented, f"read but not in the table: {sorted(undocumented)}"


def test_every_field_has_a_meaning_and_a_default_in_words():
    for cls in (*TRANSPORTS, HostEnvironment):
        for f in fields(cls):
            assert f.meaning, f"{cls.__name__}.{f.name} has no meaning for the table"
            assert "UNSET" not in f.default and "NODEFAULT" not in f.default, (cls, f.name)


def test_unset_defaults_are_resolved_by_the_adapters():
    assert NixlOptions().push_timeout_s is UNSET and NixlOptions().push_timeout == 45.0


def test_strings_from_the_environment_are_taken_as_they_are():
    env = from_env(HostEnvironment, "pd-plugins", {"PD_PEER_SECRET": " s3cret\t"})
    assert env.peer_secret == " s3cret\t"  # a secret is never trimmed, whatever engine reads it
