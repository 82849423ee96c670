import re

import pytest

from pd_plugins.routers.cli import build_parser, config_from_args
from pd_plugins.routers.config import ConfigError, config_from_mapping, parse_worker_arg


def config(*argv: str, yaml_text: str | None = None, tmp_path=None):
    args = list(argv)
    if yaml_text is not None:
        path = tmp_path / "router.yaml"
        path.write_text(yaml_text)
        args += ["--config", str(path)]
    return config_from_args(build_parser().parse_args(args))


def test_flags_give_a_working_config():
    cfg = config("--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200/",
                 "--decode", "http://127.0.0.1:8201", "--policy", "kv_cost", "--port", "9000")
    assert [w.url for w in cfg.decode] == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert cfg.port == 9000 and cfg.policy.prefill.scorers[0].name == "kv_cost"


def test_worker_options_after_the_url():
    assert parse_worker_arg(["http://h:1", "engine_id=p0", "kv_port=5600"]) == {
        "url": "http://h:1", "engine_id": "p0", "kv_port": 5600}
    assert parse_worker_arg(["http://h:1", "8998"]) == {"url": "http://h:1", "bootstrap_port": 8998}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_worker_arg(["http://h:1", "oops"])


def test_yaml_errors_name_the_bad_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown field `prefil_s` - at `\$.timeouts`"):
        config(yaml_text="decode: [{url: 'http://127.0.0.1:1'}]\ntimeouts: {prefil_s: 3}\n",
               tmp_path=tmp_path)
    with pytest.raises(ConfigError, match=r"Expected `float`, got `str` - at `\$.timeouts.prefill_s`"):
        config(yaml_text="decode: [{url: 'http://127.0.0.1:1'}]\ntimeouts: {prefill_s: soon}\n",
               tmp_path=tmp_path)
    with pytest.raises(ConfigError, match="scorer kv_cost params: .*unknown field `scale`"):
        config(yaml_text="decode: [{url: 'http://127.0.0.1:1'}]\npolicy:\n  prefill:\n"
                         "    scorers: [{name: kv_cost, params: {scale: 2}}]\n", tmp_path=tmp_path)
    with pytest.raises(ConfigError, match="not valid YAML"):
        config(yaml_text="decode: [", tmp_path=tmp_path)


def test_yaml_policy_stack_and_flags_override(tmp_path):
    cfg = config("--port", "9100", tmp_path=tmp_path, yaml_text="""
port: 9000
decode: [{url: "http://127.0.0.1:8200"}]
prefill: [{url: "http://127.0.0.1:8100", kv_events: "tcp://127.0.0.1:5557"}]
policy:
  prefill:
    scorers: [{name: prefix_cache, weight: 3}, {name: least_loaded}]
    picker: {name: random, params: {seed: 1}}
  deciders: [{name: uncached_length, params: {min_uncached_tokens: 64}}]
  admission: {name: slo, params: {ttft_slo_ms: 800}}
""")
    assert cfg.port == 9100
    assert cfg.policy.prefill.scorers[0].weight == 3
    assert cfg.policy.admission.params == {"ttft_slo_ms": 800}
    assert cfg.prefill[0].kv_events == "tcp://127.0.0.1:5557"


@pytest.mark.parametrize("argv, message", [
    ((), "no decode worker"),
    (("--decode", "ftp://x"), "must look like http://host:port"),
    (("--decode", "http://x:abc"), "must look like http://host:port"),
    (("--decode", "http://x:99999"), "must look like http://host:port"),
    (("--decode", "http://x:0"), "must look like http://host:port"),
    (("--decode", "http://a:1", "--policy", "best"), "unknown policy 'best'"),
    (("--decode", "http://a:1", "--mode", "sidecar", "--decode", "http://a:2"), "exactly one decode"),
    (("--decode", "http://a:1", "--transfer", "push", "--prefill", "http://a:2"), "needs engine_id and kv_port"),
    (("--decode", "http://a:1", "--engine", "sglang", "--prefill", "http://a:2"), "needs bootstrap_port"),
    (("--decode", "http://a:1", "kv_events_replay=tcp://a:5558"), "kv_events_replay needs kv_events"),
    (("--decode", "http://a:1", "kv_events=tcp://a:5557", "kv_events_replay=bind:tcp://a:5558"),
     "kv_events_replay must be the tcp://"),
    (("--decode", "http://a:1", "kv_events=tcp://a:5557", "kv_events_replay=tcp://*:5558"),
     "kv_events_replay must be the tcp://"),
])
def test_invalid_configurations_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        config(*argv)


def test_latency_priors_that_would_fail_every_request_are_refused():
    # link_bytes_per_s 0 divided by zero in every admission and schedule (a 500 per request)
    for latency in ({"link_bytes_per_s": 0}, {"prefill_per_token_s": -1},
                    {"decode_step_base_s": float("nan")}):
        with pytest.raises(ConfigError, match="latency priors"):
            config_from_mapping({"decode": [{"url": "http://d:1"}], "latency": latency})


DECODE = ("--decode", "http://127.0.0.1:8200")


def test_edge_options_from_flags_and_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nfile-key-1\n\n  file-key-2  \n")
    monkeypatch.setenv("PD_ROUTER_API_KEYS", "env-key-1, env-key-2,")
    cfg = config(*DECODE, "--api-key-file", str(keys), "--route-header", "full")
    assert cfg.api_keys == ["env-key-1", "env-key-2"] and cfg.api_key_file == str(keys)
    assert cfg.route_header == "full"
    from pd_plugins.routers.client_auth import load_api_keys
    assert load_api_keys(cfg) == [b"env-key-1", b"env-key-2", b"file-key-1", b"file-key-2"]
    monkeypatch.delenv("PD_ROUTER_API_KEYS")
    assert config(*DECODE).route_header == "minimal" and config(*DECODE).api_keys == []


def test_bad_edge_options_fail_at_startup_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PD_ROUTER_API_KEYS", raising=False)
    with pytest.raises(ConfigError, match="both tls_cert and tls_key"):
        config(*DECODE, "--tls-cert", str(tmp_path / "c.pem"))
    with pytest.raises(ConfigError, match=f"cannot load TLS certificate {tmp_path}/c.pem"):
        config(*DECODE, "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem"))
    with pytest.raises(ConfigError, match=f"cannot read api_key_file {tmp_path}/missing"):
        config(*DECODE, "--api-key-file", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        config(*DECODE, "--api-key-file", str(tmp_path / "empty"))
    monkeypatch.setenv("PD_ROUTER_API_KEYS", "caf\u00e9")
    with pytest.raises(ConfigError, match="printable ASCII"):
        config(*DECODE)
    monkeypatch.delenv("PD_ROUTER_API_KEYS")
    with pytest.raises(ConfigError, match="metrics_need_api_key is set but no API key"):
        config(yaml_text="decode: [{url: 'http://127.0.0.1:1'}]\nmetrics_need_api_key: true\n",
               tmp_path=tmp_path)


def test_yaml_api_keys_must_be_strings_before_the_environment_joins(tmp_path, monkeypatch):
    # a string was spread into its characters beside PD_ROUTER_API_KEYS: each one a valid key
    monkeypatch.setenv("PD_ROUTER_API_KEYS", "env-key")
    yaml_text = "decode: [{url: 'http://127.0.0.1:1'}]\napi_keys: %s\n"
    with pytest.raises(ConfigError, match=r"yaml: Expected `array`, got `str` - at `\$.api_keys`"):
        config(yaml_text=yaml_text % "sk-live-abc", tmp_path=tmp_path)
    with pytest.raises(ConfigError, match=r"Expected `str`, got `int` - at `\$.api_keys\[1\]`"):
        config(yaml_text=yaml_text % "[k0, 5]", tmp_path=tmp_path)
    assert config(yaml_text=yaml_text % "[k0]", tmp_path=tmp_path).api_keys == ["k0", "env-key"]


@pytest.mark.parametrize("section, key, value", [
    ("health", "interval_s", 0), ("health", "interval_s", -1), ("health", "interval_s", "nan"),
    ("health", "timeout_s", 0), ("health", "timeout_s", "inf"),
    ("health", "metrics_interval_s", 0), ("health", "metrics_interval_s", "nan"),
    ("health", "failure_threshold", 0), ("health", "success_threshold", 0),
    ("timeouts", "prefill_s", "nan"), ("timeouts", "connect_s", "inf"),
    ("timeouts", "client_write_s", 0), ("timeouts", "decode_idle_s", -1),
])
def test_health_and_timeouts_need_finite_positive_values(section, key, value):
    # interval_s 0 probed back to back, NaN killed the health loop or failed every request,
    # timeout_s 0 never let a worker be ready
    data = {"decode": [{"url": "http://d:1"}], section: {key: float(value)}}
    if key.endswith("threshold"):
        data[section][key] = value
    with pytest.raises(ConfigError, match=rf"{section}\.{key} must be "):
        config_from_mapping(data)


def test_kv_verify_windows_must_be_finite():
    for kv_verify in ({"window_s": float("inf")}, {"quarantine_s": float("nan")}):
        with pytest.raises(ConfigError, match="health.kv_verify"):
            config_from_mapping({"decode": [{"url": "http://d:1"}],
                                 "health": {"kv_verify": kv_verify}})


@pytest.mark.parametrize("yaml_line, flags, message", [
    ("log_level: verbose", (), r"Invalid enum value 'verbose' - at `\$.log_level`"),
    ("models: 5", (), r"Expected `array`, got `int` - at `\$.models`"),
    ("traffic_record: /tmp/x", ("--traffic-record", "/tmp/y"),
     r"Expected `object \| null`, got `str` - at `\$.traffic_record`"),
    ("discovery: kubernetes", ("--k8s-namespace", "ns"),
     r"Expected `object \| null`, got `str` - at `\$.discovery`"),
    ("api_keys: 5", (), r"Expected `array`, got `int` - at `\$.api_keys`"),
])
def test_yaml_values_the_flags_merge_into_are_type_checked(tmp_path, monkeypatch, yaml_line,
                                                           flags, message):
    # each was a traceback (TypeError, or a ValueError from logging once --check-config passed)
    monkeypatch.setenv("PD_ROUTER_API_KEYS", "env-key")
    with pytest.raises(ConfigError, match="router.yaml: " + message):
        config(*flags, yaml_text=f"decode: [{{url: 'http://127.0.0.1:1'}}]\n{yaml_line}\n",
               tmp_path=tmp_path)


@pytest.mark.parametrize("argv, message", [
    (("--port", "70000"), r"port must be within 0 and 65535 \(got 70000\)"),
    (("--port", "-5"), r"port must be within 0 and 65535 \(got -5\)"),
    (("--prefill", "http://a:2", "engine_id=p0", "kv_port=70000"),
     r"kv_port must be within 1 and 65535 \(got 70000\) - at `\$.prefill\[0\]`"),
    (("--prefill", "http://a:2", "0"), r"bootstrap_port must be within 1 and 65535"),
])
def test_ports_out_of_range_are_refused(argv, message):
    # port 70000 was accepted and the OS listened on 70000 - 65536
    with pytest.raises(ConfigError, match=message):
        config("--decode", "http://a:1", *argv)


def test_ports_at_the_edges_are_accepted():
    cfg = config("--decode", "http://a:1", "--port", "0", "--transfer", "push", "--prefill",
                 "http://a:2", "engine_id=p0", "kv_port=65535")
    assert cfg.port == 0 and cfg.prefill[0].kv_port == 65535


def test_a_scorer_without_parameters_refuses_params_at_config_check(tmp_path):
    with pytest.raises(ConfigError, match="scorer prefix_cache params: .*unknown field `x`"):
        config("--check-config", tmp_path=tmp_path, yaml_text=(
            "decode: [{url: 'http://127.0.0.1:1'}]\n"
            "policy: {decode: {scorers: [{name: prefix_cache, params: {x: 1}}]}}\n"))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("path, value", [
    ("max_body_bytes", -1), ("max_body_bytes", 0), ("max_body_bytes", 2**40),
    ("max_connections", 0), ("max_connections", 10**9),
    ("push_head_start_s", NAN), ("push_head_start_s", -5.0), ("push_head_start_s", INF),
    ("block_size", 10**15), ("block_size", 0),
    ("sessions.ttl_s", NAN), ("sessions.ttl_s", INF), ("sessions.max_sessions", 0),
    ("sessions.redis_timeout_s", NAN), ("sessions.sync_interval_s", NAN),
    ("sessions.peer_load_ttl_s", NAN), ("sessions.redis_stream_len", 5),
    ("failover.decode_retries", 10**9), ("failover.prefill_retries", -1),
    ("discovery.retry_max_s", NAN), ("discovery.retry_max_s", INF),
    ("discovery.watch_timeout_s", 10**9), ("discovery.max_pods", 0),
    ("decode[0].dp_size", 0), ("decode[0].tp_size", -1), ("decode[0].dp_size", 10**9),
    ("policy.decode.scorers[0].weight", NAN), ("policy.decode.scorers[0].weight", INF),
    ("policy.decode.scorers[0].weight", -1.0),
])
def test_sizes_durations_and_counts_out_of_bounds_are_refused_naming_the_key(path, value):
    # each was accepted: NaN passed `<= 0` checks (and killed a loop or a request later), a
    # negative body limit refused every request, 10**9 retries or a 10**15 block were kept
    data = {"decode": [{"url": "http://d:1"}],
            "policy": {"decode": {"scorers": [{"name": "least_loaded"}]}}, "discovery": {},
            "failover": {}, "sessions": {}}
    *parents, key = path.split(".")
    node = data
    for part in parents:
        name, _, index = part.partition("[")
        node = node[name][int(index[:-1])] if index else node[name]
    node[key] = value
    where = re.escape("$." + path)
    with pytest.raises(ConfigError, match=rf"Expected `(int|float)` [<>]=? \S+ - at `{where}`"):
        config_from_mapping(data)


def test_bounds_leave_the_defaults_and_their_edges_accepted():
    cfg = config_from_mapping({
        "decode": [{"url": "http://d:1", "dp_size": 1024, "tp_size": 8}], "block_size": 4096,
        "max_body_bytes": 1024, "max_connections": 1, "push_head_start_s": 0, "failover": {"decode_retries": 16},
        "sessions": {"ttl_s": 30 * 86400}, "discovery": {"retry_max_s": 3600},
        "policy": {"decode": {"scorers": [{"name": "least_loaded", "weight": 0}]}}})
    assert cfg.block_size == 4096 and cfg.decode[0].dp_size == 1024


@pytest.mark.parametrize("token", ["", " ", "secret\n", " secret", "sec\x00ret"])
def test_an_admin_token_no_client_can_send_is_refused(token):
    # '' turned the admin API on with a token no request can carry ("Bearer " loses its space)
    with pytest.raises(ConfigError, match=r"admin_token .* not empty \(got \d+ characters\)"):
        config_from_mapping({"decode": [{"url": "http://d:1"}], "admin_token": token})


def test_an_empty_admin_token_from_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("PD_ROUTER_ADMIN_TOKEN", "")
    with pytest.raises(ConfigError, match="PD_ROUTER_ADMIN_TOKEN"):
        config(*DECODE)
    monkeypatch.setenv("PD_ROUTER_ADMIN_TOKEN", "t0k3n")
    assert config(*DECODE).admin_token == "t0k3n"
    monkeypatch.delenv("PD_ROUTER_ADMIN_TOKEN")
    assert config(*DECODE).admin_token is None


def test_the_redis_password_comes_from_the_environment_apart_from_the_url(monkeypatch, tmp_path):
    """PD_ROUTER_REDIS_PASSWORD (a Secret's) beside a URL without one (a ConfigMap's); the YAML's
    own value wins; empty, or beside a password in the URL, is refused without showing it."""
    yaml_text = "sessions:\n  redis_url: redis://redis:6379/0\n"
    monkeypatch.setenv("PD_ROUTER_REDIS_PASSWORD", "s3cret")
    assert config(*DECODE, yaml_text=yaml_text, tmp_path=tmp_path).sessions.redis_password == "s3cret"
    own = yaml_text + "  redis_password: mine\n"
    assert config(*DECODE, yaml_text=own, tmp_path=tmp_path).sessions.redis_password == "mine"
    for url, password in (("redis://:other@redis:6379/0", "s3cret"), ("redis://redis:6379/0", "")):
        monkeypatch.setenv("PD_ROUTER_REDIS_PASSWORD", password)
        with pytest.raises(ConfigError, match="redis_password") as refused:
            config(*DECODE, yaml_text=f"sessions:\n  redis_url: {url}\n", tmp_path=tmp_path)
        assert "s3cret" not in str(refused.value)
    monkeypatch.delenv("PD_ROUTER_REDIS_PASSWORD")
    assert config(*DECODE, yaml_text=yaml_text, tmp_path=tmp_path).sessions.redis_password is None


@pytest.mark.parametrize("kind, name, key, value", [
    ("filter", "session_pin", "min_resident_share", ".nan"),
    ("filter", "session_pin", "min_resident_share", 2),
    ("decider", "append_prefill", "max_append_tokens", -1),
    ("decider", "append_prefill", "w_tpot", ".nan"),
    ("decider", "uncached_length", "min_uncached_tokens", 10**12),
    ("decider", "prefill_load", "margin", ".inf"),
    ("decider", "prefill_load", "max_decode_kv_usage", ".nan"),
    ("decider", "prefill_load", "min_prefill_queue", -1),
    ("filter", "expert_band", "tau", ".nan"),
    ("filter", "not_saturated", "max_waiting", ".nan"),
    ("filter", "not_saturated", "max_kv_usage", -0.5),
    ("filter", "load_band", "slack", ".nan"),
    ("filter", "load_band", "margin", ".inf"),
    ("scorer", "kv_cost", "prefill_load_scale", ".nan"),
    ("scorer", "sglang_cache_aware", "cache_threshold", ".nan"),
    ("scorer", "sglang_cache_aware", "balance_abs_threshold", -1),
    ("scorer", "sglang_cache_aware", "balance_rel_threshold", ".inf"),
    ("scorer", "mooncake_ttft", "kvcache_balancing_threshold", ".nan"),
    ("admission", "slo", "ttft_slo_ms", ".nan"),
    ("admission", "slo", "ttft_slo_ms", 0),
    ("admission", "slo", "tpot_slo_ms", -5),
    ("admission", "slo", "decode_kv_limit", 0),
    ("admission", "mooncake_slo", "kvcache_balancing_threshold", ".inf"),
])
def test_policy_parameters_out_of_bounds_are_refused_naming_piece_and_key(tmp_path, kind, name,
                                                                          key, value):
    # NaN compares false with everything: a NaN threshold silently never (or always) applied
    piece = f"{{name: {name}, params: {{{key}: {value}}}}}"
    policy = {"filter": f"{{decode: {{filters: [{piece}]}}}}",
              "scorer": f"{{prefill: {{scorers: [{piece}]}}}}",
              "decider": f"{{deciders: [{piece}]}}", "admission": f"{{admission: {piece}}}"}[kind]
    with pytest.raises(ConfigError, match=rf"{kind} {name} params: Expected `(int|float)` "
                                          rf"[<>]=? \S+ - at `\$\.{key}`"):
        config(yaml_text=f"decode: [{{url: 'http://127.0.0.1:1'}}]\npolicy: {policy}\n",
               tmp_path=tmp_path)
